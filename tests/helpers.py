"""Float64 truth for the HN-CLIP loss and comparison helpers that say where values mismatch."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from datetime import timedelta

import torch
import torch.nn.functional as F


def hn_clip_loss_f64(
    img, txt, tau, gamma=0.5, label_smoothing=0.0, reduction="mean", normalize=True, false_negative_threshold=None
):
    """Float64 evaluation of arXiv 2608.18521 Eq. 2, written independently of the package.

    The NLL is log(1 + Σ_{j≠i} exp(Z_ij − Z_ii)) (a plain LSE − Z_ii would round a 1e-30 loss
    to 0 even in float64); label smoothing uses ε·(Z_ii − mean_j Z_ij). Takes and returns
    tensors that keep autograd, so gradients of the truth come from float64 autograd.

    ``false_negative_threshold`` c: the pairs i ≠ j with float64 caption cosine t̂_i·t̂_j ≥ c
    (the captions' cosine whatever ``normalize`` says) leave both softmaxes (the sums over j run over the kept columns) and label smoothing
    averages over the kept classes. Callers keep every cosine away from c (float32 backends
    compare a float32 cosine).
    """
    v, t = img.double(), txt.double()
    tau = tau.double() if isinstance(tau, torch.Tensor) else torch.tensor(float(tau), dtype=torch.float64)
    if normalize:
        v, t = F.normalize(v, dim=1), F.normalize(t, dim=1)
    n = v.shape[0]
    eye = torch.eye(n, dtype=torch.bool)
    margin = (t @ t.T).detach().masked_fill(eye, 0.0)
    logits = (v @ t.T + gamma * margin) / tau
    dropped = eye
    if false_negative_threshold is not None:
        unit = F.normalize(t.detach(), dim=1)
        cos = unit @ unit.T
        dropped = eye | (0.5 * (cos + cos.T) >= false_negative_threshold)  # symmetric by construction
    per_dir = []
    for z in (logits, logits.T):
        diag = z.diagonal()
        gaps = (z - diag[:, None]).masked_fill(dropped, float("-inf"))
        # log(1 + Σ_{j≠i} exp(gap)): logaddexp keeps 1e-30 and 1e+30 alike (no exp overflow)
        nll = torch.logaddexp(torch.zeros_like(diag), torch.logsumexp(gaps, dim=1)) if n > 1 else diag * 0
        if false_negative_threshold is None:
            per_dir.append(nll + label_smoothing * (diag - z.mean(dim=1)))
            continue
        kept = (~dropped).sum(dim=1) + 1  # the kept negatives and the positive
        kept_mean = (z.masked_fill(dropped, 0.0).sum(dim=1) + diag) / kept
        per_dir.append(nll + label_smoothing * (diag - kept_mean))
    rows = 0.5 * (per_dir[0] + per_dir[1])
    return {"mean": rows.mean(), "sum": rows.sum(), "none": rows}[reduction]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 (absolute error when expected is 0)."""
    a, e = actual.detach().double(), expected.detach().double()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close_rel(actual, expected, tol: float, what: str = "value") -> None:
    """Relative-norm check; on failure report the worst element and where it is."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.isfinite(a).all() == torch.isfinite(e).all(), f"{what}: non-finite mismatch\n{a}\n{e}"
    err = rel_err(a, e)
    if not err <= tol:
        diff = (a - e).abs().reshape(-1)
        worst = int(diff.argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)) if a.dim() else ()
        raise AssertionError(
            f"{what}: relative error {err:.3e} > {tol:.1e}; worst at {idx}: "
            f"got {a.reshape(-1)[worst].item():.10e}, expected {e.reshape(-1)[worst].item():.10e}"
        )


def collect_rank_reports(q, procs, world: int, timeout: float) -> dict:
    """Reports of spawned ranks: ``{rank: rest of its tuple}`` for each tuple ``(rank, ...)`` read from
    ``q`` until all ``world`` ranks reported, every process ended, or ``timeout`` seconds passed;
    then every process is joined (killed if it still runs). A missing rank is a hang or a crash."""
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, *report = q.get(timeout=1.0)
                results[rank] = tuple(report)
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and q.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def _gloo_rank(body, rank, world, init_method, pg_timeout_s, args, q):
    """One spawned rank: a gloo process group, then ``(rank, body(rank, world, *args), None)`` on
    ``q``, or ``(rank, None, the traceback)`` if anything raised."""
    try:
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.distributed.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout_s)
        )
        q.put((rank, body(rank, world, *args), None))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, None, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def spawn_gloo_ranks(body, tmp_path, *args, world: int = 2, timeout: float = 240.0, pg_timeout_s: float = 60) -> dict:
    """``body(rank, world, *args)`` in ``world`` spawned processes joined in one gloo process group
    (its rendezvous a file under ``tmp_path``): ``{rank: what body returned}``. Fails naming each rank
    that did not report within ``timeout`` seconds (a hang or a crash) or that raised (its traceback).
    ``body`` must be a module-level function (spawn pickles it by name) returning what pickles by
    value (numpy arrays: a tensor would be shared memory that dies with its process)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init_method = f"file://{tmp_path / 'pg'}"
    procs = [
        ctx.Process(target=_gloo_rank, args=(body, r, world, init_method, pg_timeout_s, args, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = collect_rank_reports(q, procs, world, timeout)
    assert sorted(results) == list(range(world)), f"ranks reported: {sorted(results)} (hang or crash)"
    for rank, (_, tb) in results.items():
        assert tb is None, f"rank {rank}:\n{tb}"
    return {rank: report for rank, (report, _) in results.items()}
