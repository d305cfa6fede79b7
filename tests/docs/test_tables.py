"""The docs' tables of counted figures are what their tools print now.

Each generated region of the docs (``<!-- generated: NAME ... -->`` … ``<!-- end generated -->``,
see tools/docs_tables.py) is regenerated in a fresh process and compared; a difference fails
with a diff and the command that rewrites it (``python -m tools.docs_tables --write``).

Cost, measured on one core: ``workspace`` ~5 s, each ``study-*`` table ~1 s; ``work-rank`` ~1 min;
``work-family`` ~2.3 min (measured in 2 processes on 2 loaded cores); ``work-loss`` ~3 min,
2.7 of them its two N = 1024 loss cases under the interpreter (the work cases run in one process
per CPU, so about half that on CI's 2 cores); ``sm90-registers`` the launch capture (~50 s)
plus, cold, the sm_90a compile of the ``--quick`` kernels, which
tests/tooling/test_sm90_compile.py, run after it, then finds in the same cache directory: it
is marked ``sm90`` like that test and skipped where the toolchain is missing.
"""

import pytest

from tools import docs_tables

CHEAP = ["workspace", "work-rank", "work-family", "work-loss"]


def test_every_table_has_a_region_and_every_region_a_table():
    found = docs_tables.regions()
    assert set(found) == set(docs_tables.TABLES), (
        f"generated regions in the docs: {sorted(found)}; tables tools.docs_tables generates: "
        f"{sorted(docs_tables.TABLES)}"
    )


def _check(name, progress=None):
    table = docs_tables.generate(name, progress=progress)
    problems = [d for page, old in docs_tables.regions()[name] if (d := docs_tables.diff(name, page, old, table))]
    if problems:
        pytest.fail(
            "a table in the docs differs from what its tool prints now:\n\n" + "\n\n".join(problems), pytrace=False
        )


@pytest.mark.parametrize("name", CHEAP)
def test_docs_table_is_what_its_tool_prints(name):
    _check(name)


@pytest.mark.parametrize("name", docs_tables.STUDY_TABLES + docs_tables.SIGLIP_STUDY_TABLES)
def test_study_table_is_what_the_committed_runs_give(name):
    """The fine-tuning study's regions (default tier: about a second each) against its committed CSVs."""
    _check(name)


def test_sigmoid_benchmark_table_is_what_the_committed_sweep_gives():
    """docs/benchmarks.md's sigmoid table against benchmarks/results/cpu_sigmoid_results.csv (about a second)."""
    _check("bench-sigmoid-cpu")


@pytest.mark.sm90
def test_docs_register_table_is_what_tools_sm90_prints(capsys):
    from tools.sm90 import missing_toolchain

    reason = missing_toolchain()
    if reason:
        pytest.skip(reason)

    def progress(line):  # the header and a line per compiled kernel, on the terminal as they come
        if line.startswith(("triton ", "  compiled ")):
            with capsys.disabled():
                print(f"[sm90] {line.strip()}", flush=True)

    _check("sm90-registers", progress)


def test_a_changed_figure_fails_with_a_diff_and_the_fix():
    table = "| | γ = 0 |\n|---|---|\n| N = 256 | 2 + 2 = 4 (1.33×) |"
    page = docs_tables.body("work-loss", table)
    assert docs_tables.diff("work-loss", "docs/triton.md", page, table) == ""
    stale = docs_tables.diff("work-loss", "docs/triton.md", page.replace("1.33×", "1.34×"), table)
    assert "-| N = 256 | 2 + 2 = 4 (1.34×) |" in stale and "+| N = 256 | 2 + 2 = 4 (1.33×) |" in stale, stale
    assert stale.endswith("python -m tools.docs_tables --write --tables work-loss"), stale


def test_register_table_groups_kernels_by_width_and_candidate():
    from tools.sm90 import markdown_table

    def row(kernel, dtypes, cfg, gamma, regs, blocks="M128 N32 K64", spill=0, shared=122880):
        return dict(
            kernel=kernel,
            dtype=dtypes[0],
            dtypes=dtypes,
            cfg=cfg,
            gamma=gamma,
            regs=regs,
            blocks=blocks,
            num_warps=8,
            num_stages=3,
            spill_st=spill,
            spill_ld=spill,
            shared=shared,
        )

    rows = [
        row("_fwd_kernel", ["bf16"], "1/2", [0.0], 150),
        row("_fwd_kernel", ["fp16"], "1/2", [0.0], 165),
        row("_fwd_kernel", ["bf16"], "1/2", [0.5], 216),
        row("_fwd_kernel", ["fp16"], "1/2", [0.5], 240, spill=8),
        row("_fwd_kernel", ["fp32"], "", [0.0, 0.5], 168, blocks="M64 N32 K32", shared=40960),
        row("_merge_kernel", ["bf16", "fp16", "fp32"], "", [0.0, 0.5], 32, blocks="-", shared=0),
    ]
    report = dict(
        rows=rows,
        problems=["_fwd_kernel ... spills 8/8 B"],
        launches=9,
        triton="3.8.0",
        target="sm_90a",
        config=dict(
            dtypes=["bf16", "fp16", "fp32"],
            D=[64, 768],
            gammas=[0.0, 0.5],
            smoothings=[0.0],
            thresholds=[None],
            n=4096,
            local_m=512,
        ),
    )
    head, table = markdown_table(report).split("\n\n")
    assert head == (
        "triton 3.8.0, sm_90a; bf16, fp16, fp32; D = 64, 768; γ = 0, 0.5; label smoothing 0; "
        "false-negative threshold None; N = 4096, a rank's M = 512: 9 launches, 6 distinct kernels, "
        "1 problem."
    )
    assert table.splitlines()[2:] == [
        "| `_fwd_kernel` | bf16, fp16 | 1/2 | M128 N32 K64 | 8 / 3 | 150–165 | 216–240 | 8 / 8 | 120 |",
        "| `_fwd_kernel` | fp32 | - | M64 N32 K32 | 8 / 3 | 168 | 168 | 0 | 40 |",
        "| `_merge_kernel` | bf16, fp16, fp32 | - | - | 8 / 3 | 32 | 32 | 0 | 0 |",
    ]


def test_a_changed_study_result_fails_with_a_diff(tmp_path):
    """The study's regions follow its CSVs: one changed held-out figure changes the generated text,
    and the check reports it with a diff and the fix."""
    import shutil

    import study_tables

    folder = tmp_path / "run"
    shutil.copytree(study_tables.COMMITTED, folder)
    data = study_tables.load(str(folder))
    now = study_tables.TABLES["study-results"](data)
    page = docs_tables.body("study-results", now)
    assert docs_tables.diff("study-results", "docs/studies.md", page, now) == ""
    rows = data["final"]
    row = next(r for r in rows if r["arm"] == "HN-CLIP")
    row["t2i_R@1"] = str(float(row["t2i_R@1"]) + 0.25)
    changed = study_tables.TABLES["study-results"](data)
    stale = docs_tables.diff("study-results", "docs/studies.md", page, changed)
    assert stale.startswith("--- docs/studies.md (study-results, in the docs)"), stale
    assert stale.endswith("python -m tools.docs_tables --write --tables study-results"), stale
