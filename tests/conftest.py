"""Test setup: without a CUDA device, Triton kernels run in its CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported (torch does not import it).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# one thread a worker under pytest-xdist (-n 2: two workers on two cores), else at most two
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


@pytest.fixture(params=["interpret", "gpu"])
def launch(request, monkeypatch):
    """Each Triton launch configuration under the interpreter: its own small tiles, then the
    GPU's (``HNCLIP_TRITON_LAUNCH=gpu``: the tiles, warps and splits an H200 runs)."""
    from hnclip_kernels.backends.triton import config as cfg

    if request.param == "gpu":
        monkeypatch.setenv("HNCLIP_TRITON_LAUNCH", "gpu")
    else:
        monkeypatch.delenv("HNCLIP_TRITON_LAUNCH", raising=False)
    assert cfg.launch_mode() == request.param
    return request.param


# ------------------------------------------------------------------ the two tiers
# `python -m pytest tests -q` runs the default tier: every backend and op against float64 at small
# sizes, the API, the snippets. `--full` adds the tests marked `slow` (`-m slow` alone runs only
# them; `--full -m slow` too, which is what .ci/run runs after the default tier). A test is in the
# full tier when it is listed here (by file, or file::test) or marked `@pytest.mark.slow`/`sm90`.
# Seconds: `--durations=0` on 2 cores at a load of 4-5 (about 1.6× an idle machine's); the tiers'
# times: docs/testing.md. An entry that names a collected file but matches no test is an error.
FULL_TIER = (
    # the docs: the counted tables regenerated (work-loss, work-rank, workspace: 175 s; work-family: 138 s),
    # the site (4 s), the open_clip_train smoke run (5 s)
    "tests/docs/test_tables.py::test_docs_table_is_what_its_tool_prints",
    "tests/docs/test_site.py",
    "tests/docs/test_snippets.py::test_smoke_run_commands_train",
    # hypothesis sweeps and long parametrisations (the float64 checks of every op stay in the default tier)
    "tests/backends/test_saturated_rows.py::test_rows_triton",  # 86 s
    "tests/backends/test_triton_rank.py::test_rank_op_equals_two_directional_ops_bitwise",  # 32 s
    "tests/backends/test_triton_rank.py::test_masked_rank_op_equals_two_directional_ops_bitwise",  # 18 s
    "tests/backends/test_triton_hostile.py::test_tile_edges_nonuniform_upstream",  # 15 s
    "tests/api/test_hard_negatives_triton.py::test_combinations_and_dtypes",  # 14 s (72 cases)
    "tests/api/test_hard_negatives_triton.py::test_hypothesis_draws_match_the_oracle",  # 33 s (30 draws)
    "tests/backends/test_triton_hostile.py::test_ragged_chunks_and_many_splits_gpu_launch",  # 11 s
    # the stated FLOPs past one tile (the N = 10 case, one tile, stays in the default tier)
    "tests/api/test_hard_negatives_triton.py::test_flops_count_the_negative_columns_useful_products[70]",  # 9 s
    # torch.compile schedules and traces (many recompiles)
    "tests/backends/test_triton_library.py::test_compile_fullgraph_schedule_compiles_at_most_twice",  # 45 s
    "tests/backends/test_triton_library.py::test_traced_for_inductor_without_gpu",  # 11 s
    "tests/backends/test_triton_ops_kernels.py::test_each_operator_finds_exactly_its_kernels",  # 9 s
    "tests/backends/test_triton_family_nll.py::test_operators_find_exactly_their_kernels",  # 24 s
    "tests/api/test_api.py::test_compile_fullgraph_with_changing_floats",  # 15 s
    "tests/api/test_composability.py::test_compile_schedule_compiles_at_most_twice",  # 10 s
    "tests/api/test_composability.py::test_masked_threshold_schedule_compiles_at_most_twice",  # 4 s
    # the workspace and work counts (figures, not correctness)
    "tests/backends/test_workspace.py::test_slabs_fold_columns_gpu_launch",  # 22 s
    "tests/backends/test_triton_family_nll.py::test_family_workspace_counted",  # 52 s (4 cases)
    "tests/backends/test_workspace.py::test_symmetric_workspace_counted",  # 12 s
    "tests/backends/test_workspace.py::test_rank_workspace_counted",  # 8 s
    "tests/tooling/test_work_count.py",  # 54 s, and 29 s for the family's 7 formula cases
    # spawned process groups (gloo), training runs and the examples
    "tests/distributed/test_distributed.py",  # 64 s
    "tests/distributed/test_family_distributed.py::test_two_ranks_unequal_n_and_m_equal_the_concatenated_batch",  # 11 s
    "tests/distributed/test_family_distributed.py::test_two_ranks_triton_family_equal_the_concatenated_batch",  # 16-26 s
    "tests/distributed/test_own_distributed.py",  # 18 s
    "tests/integrations/test_chunked.py::test_two_gloo_ranks_ddp_and_fsdp2",  # 24 s
    "tests/distributed/test_uneven_tower_calls.py",  # 60 s at load 6, 111 s at 8 (one spawn: 8 FSDP2, 3 ZeRO-3 cases)
    "tests/integrations/test_transformers.py::test_two_gloo_processes_equal_the_global_batch",  # 26 s
    "tests/integrations/test_deepspeed.py",  # 41 s
    "tests/integrations/test_example.py",  # 26 s
    "tests/integrations/test_fine_tune_study.py",  # 22 s idle, 70 s at load 5 on 2 cores; + 35 s at load 8 (--arm-set siglip)
    "tests/integrations/test_long_clip_example.py",  # 31 s
    "tests/integrations/test_train.py",  # 16 s
    "tests/integrations/test_train_checks.py::test_the_cli_exits_with_one_line",  # 7-11 s: torch's and open_clip's imports
    # the tools: benchmark sweeps, the GPU check script, the precision study, the clean-tree runs
    "tests/tooling/test_benchmarks_smoke.py",  # 63 s
    "tests/tooling/test_chunked_memory_smoke.py",  # 26 s
    "tests/tooling/test_negatives_benchmark_smoke.py::test_quick_cpu_sweep_writes_csv_plot_and_table",  # 23 s
    "tests/tooling/test_clean_tree.py",  # 43 s
    "tests/tooling/test_gpu_check.py",  # 14 s
    "tests/tooling/test_precision_study.py",  # 8 s
    # and every test marked sm90 (the sm_90a compiles: 44 s cached, 15 min and more cold)
)


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="also run the full tier (tests marked slow: long sweeps, training runs, the docs site, sm_90a compiles)",
    )


def _entries(nodeid):
    return [e for e in FULL_TIER if nodeid == e or nodeid.startswith(e + "::") or nodeid.startswith(e + "[")]


def pytest_collection_modifyitems(config, items):
    matched = set()
    for item in items:
        entries = _entries(item.nodeid)
        matched.update(entries)
        if entries or item.get_closest_marker("sm90"):
            item.add_marker(pytest.mark.slow)
    # a run that picks single tests (a node id, -k) collects only part of a file: nothing to check
    if any("::" in arg for arg in config.args) or config.option.keyword:
        return
    files = {item.nodeid.split("::")[0] for item in items}
    stale = [e for e in FULL_TIER if e not in matched and e.split("::")[0] in files]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py FULL_TIER names tests that do not exist: {stale}")
    if config.getoption("full") or "slow" in (config.getoption("markexpr") or ""):
        return
    # a file named on the command line runs whole: `python -m pytest tests/integrations/test_train.py`
    named = {
        os.path.relpath(os.path.abspath(arg.split("::")[0]), str(config.rootpath)).replace(os.sep, "/")
        for arg in config.args
        if arg.split("::")[0].endswith(".py")
    }
    kept, slow = [], []
    for item in items:
        full_only = item.get_closest_marker("slow") and item.nodeid.split("::")[0] not in named
        (slow if full_only else kept).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = kept
