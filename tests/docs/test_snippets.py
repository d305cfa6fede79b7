"""The snippets and commands of the README and the docs run as printed: the README's quickstart
(a real open_clip ViT-B-32, random weights), docs/train.md's CPU smoke run of
``python -m hnclip_kernels.train``, docs/transformers.md's snippets and docs/distributed.md's
``hnclip_kernels.sharding`` snippets (tiny models). Bound:
about a minute on 2 idle cores."""

import os
import re
import sys

import pytest

pytest.importorskip("open_clip")
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
README = os.path.join(ROOT, "README.md")


def test_quickstart_snippet_runs(capsys):
    text = open(README, encoding="utf-8").read()
    section = text[text.index("## Quickstart") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code, "README quickstart", "exec"), scope)
    loss, model = scope["loss"], scope["model"]
    assert loss.ndim == 0 and loss.item() > 0
    assert model.logit_scale.grad is not None and model.logit_scale.grad.item() != 0  # "reaches logit_scale too"
    out = capsys.readouterr().out
    assert out.startswith(f"loss {loss.item():.4f}, dL/d model.logit_scale ")


def _section(title, page):
    text = open(os.path.join(ROOT, "docs", page), encoding="utf-8").read()
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end >= 0 else None]


def test_smoke_run_commands_train(tmp_path):
    """The two commands of docs/train.md's "A smoke run on CPU", run in a scratch folder (about 20 s on 2 cores)."""
    import subprocess

    pytest.importorskip("open_clip_train.main")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    block = re.search(r"```bash\n(.*?)```", _section("## A smoke run on CPU", "train.md"), re.S).group(1)
    commands = [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    assert len(commands) == 2 and commands[1].startswith("python -m hnclip_kernels.train ")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    for command in commands:
        command = command.replace("examples/", os.path.join(repo, "examples", ""))
        command = command.replace("python ", f"{sys.executable} ", 1)
        proc = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    header = (tmp_path / "smoke" / "train.csv").read_text().splitlines()[0]
    assert header == "filepath\ttitle"
    (log,) = (tmp_path / "smoke" / "logs").glob("*/out.log")
    text = log.read_text()
    assert text.count("HN-CLIP stats (") == 8 and text.count("Contrastive_loss:") == 8  # 2 epochs of 4 steps


def test_transformers_snippets_run(tmp_path):
    """The Hugging Face section's two snippets, with a tiny CLIPModel and an in-memory dataset."""
    pytest.importorskip("transformers")
    import torch
    from test_transformers import PairData, batch, tiny_model
    from transformers import TrainingArguments

    snippets = re.findall(r"```python\n(.*?)```", _section("# Hugging Face transformers", "transformers.md"), re.S)
    assert len(snippets) == 2 and len(snippets[0].strip().splitlines()) == 6  # the Trainer snippet, as ruff formats it
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    scope = dict(model=tiny_model().train(), training_args=args, dataset=PairData(8))
    exec(compile(snippets[0], "README transformers Trainer", "exec"), scope)
    assert scope["trainer"].state.global_step == 2
    ids, pixels, mask = batch()
    scope = dict(model=tiny_model(), batch=dict(input_ids=ids, pixel_values=pixels, attention_mask=mask))
    exec(compile(snippets[1], "README transformers loop", "exec"), scope)
    assert scope["loss"].ndim == 0 and torch.isfinite(scope["loss"])
    assert scope["model"].logit_scale.grad is not None


def test_sharding_snippets_run(tmp_path):
    """docs/distributed.md's "FSDP2 and DeepSpeed ZeRO": the two snippets in one process, the full
    state dict being the bare model's; the saved logit_scale comes back 0-dim, bit for bit."""
    pytest.importorskip("transformers")
    import torch
    from test_transformers import tiny_model
    from transformers import CLIPModel

    unsqueeze, save = re.findall(
        r"```python\n(.*?)```", _section("## FSDP2 and DeepSpeed ZeRO", "distributed.md"), re.S
    )
    scope = dict(model=tiny_model())
    exec(compile(unsqueeze, "docs/distributed.md unsqueeze", "exec"), scope)
    model = scope["model"]
    assert scope["names"] == ("logit_scale",) and model.logit_scale.shape == (1,)
    with torch.no_grad():
        model.logit_scale.add_(0.125)  # a "trained" value
    scope.update(state=model.state_dict(), out_dir=str(tmp_path))
    exec(compile(save, "docs/distributed.md save", "exec"), scope)
    back = CLIPModel.from_pretrained(str(tmp_path)).logit_scale
    assert back.shape == () and torch.equal(back.detach(), model.logit_scale.detach().reshape(()))
