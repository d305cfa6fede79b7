"""``hnclip_kernels.chunked``'s agreement on tower calls, on one process: ``padded_encode`` with more
calls than the rank's own makes exactly that many encoder calls, forward and backward, returns the
unpadded features and gradients bit for bit (dropout on: the padding calls leave the RNG as it was),
and ``agree_tower_calls`` makes no collective without a process group. The 2-rank runs under
per-layer FSDP2 and ZeRO-3: ``tests/distributed/test_uneven_tower_calls.py`` (full tier)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hnclip_kernels.chunked import agree_tower_calls, chunked_encode, padded_encode, tower_calls


class _Tower(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.Linear(8, 3))
        self.forwards = self.backwards = 0
        self.layer.register_forward_pre_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))
        self.layer.register_full_backward_hook(lambda *_: setattr(self, "backwards", self.backwards + 1))

    def forward(self, x):
        return self.layer(x)


def _run(calls, chunk, rows=7, inputs=True):
    tower = _Tower()
    x = torch.randn(rows, 5, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(2)
    out = padded_encode(tower, x if inputs else None, chunk, calls, filler=x)
    after = torch.rand(1)  # the RNG after the pass: the padding must not have moved it
    if out.shape[0]:
        (out * torch.arange(1.0, 4.0)).sum().backward()
    else:
        out.sum().backward()
    grads = [p.grad.clone() for p in tower.parameters()]
    return out.detach(), grads, after, (tower.forwards, tower.backwards)


@pytest.mark.parametrize("chunk, own", [(None, 1), (7, 1), (3, 3)])
def test_padding_calls_change_nothing_but_the_call_count(chunk, own):
    assert tower_calls(7, chunk) == own
    want, want_grads, want_rng, (forwards, _) = _run(own, chunk)
    assert forwards == (1 if own == 1 else 2 * own)  # several chunks: each recomputed in the backward
    got, grads, rng, (forwards, backwards) = _run(own + 2, chunk)
    assert forwards == 2 * (own + 2)  # every call checkpointed: forward and recompute
    assert backwards == own + 2  # the backward runs through the padding calls too
    assert torch.equal(got, want) and torch.equal(rng, want_rng)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))


def test_a_rank_without_rows_pads_from_the_filler():
    got, grads, _, (forwards, backwards) = _run(2, 3, inputs=False)
    assert got.shape == (0, 3) and forwards == 4 and backwards == 2
    assert all(not g.any() for g in grads)  # zero weight
    assert padded_encode(_Tower(), None, 3, 0) is None


def test_bad_calls_raise():
    x = torch.randn(7, 5)
    with pytest.raises(ValueError, match="at least this rank's 3 encoder calls, got 2"):
        padded_encode(_Tower(), x, 3, 2)
    with pytest.raises(ValueError, match="filler"):
        padded_encode(_Tower(), None, 3, 1)
    with pytest.raises(ValueError, match="at least this rank's 3 encoder calls, got 1"):
        chunked_encode(_Tower(), x, 3, calls=1)


def test_no_collective_without_a_process_group(monkeypatch):
    assert not torch.distributed.is_initialized()
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: pytest.fail("a collective on one process"))
    assert agree_tower_calls(3, 0) == (3, 0)
    x, tower = torch.randn(7, 5), _Tower().eval()
    assert torch.equal(chunked_encode(tower, x, 3), torch.cat([tower(x[i : i + 3]) for i in (0, 3, 6)]))
