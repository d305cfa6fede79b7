"""The README's quickstart runs as printed (a real open_clip ViT-B-32, random weights)."""
import os
import re

import pytest

pytest.importorskip("open_clip")
README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_quickstart_snippet_runs():
    text = open(README, encoding="utf-8").read()
    section = text[text.index("## Quickstart"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code, "README quickstart", "exec"), scope)
    loss, model = scope["loss"], scope["model"]
    assert loss.ndim == 0 and loss.item() > 0
    assert model.logit_scale.grad is not None and model.logit_scale.grad.item() != 0  # "reaches logit_scale too"
