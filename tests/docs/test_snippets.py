"""The snippets and commands of the README and the docs run as printed.

The rule (docs/testing.md, "Snippets"): every ```python block of README.md and docs/*.md runs as
shown. A page's blocks run top to bottom in one fresh namespace, in a scratch directory, as a
reader pasting them into one session would (random weights, tiny configs, nothing downloaded).
A block that is deliberately partial (lines of a training script, a step that needs a sharded
model) starts with the line ``# fragment: needs NAME, NAME`` and is left out of that run; the
names it lists must be exactly the ones it uses without defining them, and some fragments run
in a test of their own with those names given (the sharding ones below). Also: docs/train.md's
CPU smoke run of ``python -m hnclip_kernels.train``, and .ci/run runs the README's commands.
Bound: about a minute and a half on 2 idle cores (the README's ViT-B-32 and the two pages with
open_clip and Hugging Face models most of it)."""

import builtins
import os
import re
import symtable
import sys

import pytest

pytest.importorskip("open_clip")
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
README = os.path.join(ROOT, "README.md")
FRAGMENT = "# fragment: needs "
PAGES = ["README.md"] + sorted(
    f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")
)


def _blocks(page):
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def _free_names(code):
    """Names the block reads but neither assigns nor imports (builtins aside), in any scope."""
    top = symtable.symtable(code, "snippet", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    free, tables = set(), [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for sym in table.get_symbols():
            global_ref = table is top or sym.is_global()
            if global_ref and sym.is_referenced() and not sym.is_assigned() and not sym.is_imported():
                free.add(sym.get_name())
    return free - defined - set(dir(builtins))


def _check_readme(scope, out):
    loss, model = scope["loss"], scope["model"]
    assert loss.ndim == 0 and loss.item() > 0
    assert model.logit_scale.grad is not None and model.logit_scale.grad.item() != 0  # "reaches logit_scale too"
    assert out.startswith(f"loss {loss.item():.4f}, dL/d model.logit_scale ")


def _check_transformers(scope, out):
    import torch

    assert scope["trainer"].state.global_step == 2
    assert scope["loss"].ndim == 0 and torch.isfinite(scope["loss"])
    assert scope["model"].logit_scale.grad is not None


def _check_large_batches(scope, out):
    assert scope["trainer"].hn_options["chunk_size"] == 32 and scope["trainer"].state.global_step == 2
    assert scope["model"].logit_scale.grad is not None and scope["txt"].shape == (8, 512)  # the open_clip model
    lora_trainer = scope["lora_trainer"]  # the LoRA section: the trainer ran chunked on the PeftModel
    assert lora_trainer.hn_options["chunk_size"] == 32 and lora_trainer.state.global_step == 2
    for peft_model in (scope["lora_clip"], scope["dora_oc"]):  # adapters (and the freed logit_scale) trained
        params = list(peft_model.named_parameters())
        trained = ("lora_", "logit_scale") if peft_model is scope["lora_clip"] else ("lora_",)
        assert all((p.grad is not None) == p.requires_grad == any(t in name for t in trained) for name, p in params)


def _check_hard_negatives(scope, out):
    import torch

    assert scope["trainer"].state.global_step == 2 and scope["batch"]["negative_input_ids"].shape[:2] == (8, 2)
    assert scope["neg"].shape == (24, 512) and torch.isfinite(scope["loss"])
    assert out.rstrip().splitlines()[-1].startswith("24 negatives, loss ")


CHECKS = {
    "docs/hard_negatives.md": _check_hard_negatives,
    "README.md": _check_readme,
    "docs/transformers.md": _check_transformers,
    "docs/large_batches.md": _check_large_batches,
}
RUNNABLE = [page for page in PAGES if any(not b.startswith(FRAGMENT) for b in _blocks(page))]


@pytest.mark.parametrize("page", RUNNABLE)
def test_page_snippets_run_as_shown(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # what a snippet writes (a Trainer's output_dir) lands here
    scope = {"__name__": "__main__"}
    for k, code in enumerate(_blocks(page), 1):
        if not code.startswith(FRAGMENT):
            exec(compile(code, f"{page}, python block {k}", "exec"), scope)
    CHECKS.get(page, lambda scope, out: None)(scope, capsys.readouterr().out)


def test_fragments_name_what_they_need():
    fragments = 0
    for page in PAGES:
        for k, code in enumerate(_blocks(page), 1):
            if code.startswith(FRAGMENT):
                fragments += 1
                listed = {n.strip() for n in code[len(FRAGMENT) :].split("\n")[0].split("(")[0].split(",")}
                assert listed == _free_names(code), f"{page}, python block {k}: lists {listed}"
            else:
                assert not code.lstrip().startswith("# fragment"), f"{page}, python block {k}: {FRAGMENT!r}..."
    assert fragments >= 1


def test_free_names_finds_what_a_block_does_not_define():
    code = "import torch\nx = torch.ones(2)\nf = lambda: y + x\nprint([z for z in w])\n"
    assert _free_names(code) == {"y", "w"}


def test_ci_runs_the_readme_install_and_test_commands():
    """.ci/run installs with the README's GPU block and runs its test block, line for line."""
    readme = open(README, encoding="utf-8").read()
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read().splitlines()
    install = readme[readme.index("## Install") : readme.index("## Test")]
    gpu_block = re.findall(r"```bash\n(.*?)```", install, re.S)[0].strip()
    test_block = re.findall(r"```bash\n(.*?)```", readme[readme.index("## Test") :], re.S)[0]
    assert gpu_block in ci
    for command in test_block.strip().splitlines():
        for part in command.split(" && "):
            assert part.strip() in ci, part


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
