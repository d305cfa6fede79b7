"""A FastCLIP-style step: per-sample moving estimates of each direction's global normaliser, fed
by ``hn_clip_loss(reduction="directions")``.

FastCLIP (Wei et al., 2024, arXiv 2407.01445) optimises a global contrastive loss whose
normaliser, a mean over the whole dataset, a mini-batch cannot form. It keeps for every sample i
and each direction a moving estimate u_i of that normaliser and weights the normaliser's gradient
by 1/u_i (a compositional gradient: ∇ log g ≈ ∇g / u). The estimator written here, per direction,
with the batch's own log-partition LSE_i (``DirectionRows.lse_i2t`` / ``lse_t2i``) standing in
for the normaliser's sample and a constant ``shift`` (the logits' bound (1 + γ)/τ for unit
features) keeping exp() in range::

    g_i = exp(LSE_i − shift)                      (detached)
    u_i ← (1 − γ_u)·u_i + γ_u·g_i                 (u_i = g_i at the sample's first visit)
    step objective = mean_i [(g_i / u_i)·LSE_i − Z_i,pos]
                   = mean_i [loss_i + (g_i / u_i − 1)·LSE_i]          (ε = 0: loss_i = LSE_i − Z_i,pos)

so its gradient is mean_i [(g_i/u_i)·∇LSE_i − ∇Z_i,pos], each row's softmax weighted by g_i/u_i:
a per-row weight on the loss (1/N) and on the LSE ((g_i/u_i − 1)/N), the combination the
directions' rows are for. With γ_u = 1 (u = g) it is the plain mini-batch loss's gradient. The
objective is averaged over the two directions. FastCLIP's temperature updates and its
distributed gradient reduction are left out; this is the estimator and the weighted step only.

Runs as is on toy data (two linear towers on clustered random pairs, a dataset of 48 samples in
batches of 16)::

    python examples/fastclip_u_estimator.py
    python examples/fastclip_u_estimator.py --backend torch --steps 6 --gamma-u 0.5

At the first step it checks the step against a materialised float64 version of the same step
(the dense logits, their logsumexp, the same u update and objective; every tower gradient and
every updated u_i; printed as ``check:``, exit status 1 beyond ``TOL``); tests/integrations/
test_fastclip_example.py runs that check on every backend.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from hnclip_kernels import hn_clip_loss

# float32 step against the float64 one: relative error of each gradient (in norm) and of u
TOL = 1e-4
N_SAMPLES, BATCH, D_IN, D = 48, 16, 12, 8


def toy_data(seed: int = 0):
    """(images, captions) of ``N_SAMPLES`` clustered pairs, (N_SAMPLES, D_IN) each, float32."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(6, D_IN, generator=gen)
    which = torch.randint(0, 6, (N_SAMPLES,), generator=gen)
    images = centres[which] + 0.5 * torch.randn(N_SAMPLES, D_IN, generator=gen)
    captions = images + 0.7 * torch.randn(N_SAMPLES, D_IN, generator=gen)
    return images, captions


class Towers(torch.nn.Module):
    """Two linear towers D_IN → D."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.image = torch.nn.Linear(D_IN, D)
        self.text = torch.nn.Linear(D_IN, D)

    def forward(self, images, captions):
        return self.image(images), self.text(captions)


def estimator_update(u_old: torch.Tensor, lse: torch.Tensor, shift: float, gamma_u: float):
    """(g, the updated u) of one direction's rows (float64): g = exp(LSE − shift) detached,
    u ← (1 − γ_u)·u + γ_u·g, and u = g where u_old is 0 (a sample's first visit)."""
    g = torch.exp(lse.detach().double() - shift)
    u_new = torch.where(u_old > 0, (1.0 - gamma_u) * u_old + gamma_u * g, g)
    return g, u_new


def step_objective(rows, u: dict, index: torch.Tensor, *, shift: float, gamma_u: float):
    """The step's objective (float64, differentiable) from ``DirectionRows`` and each direction's
    updated u of the batch's samples ``index`` (``u``: {"i2t", "t2i"} → (N_SAMPLES,) float64)."""
    objective, updated = 0.0, {}
    for name, loss, lse in (("i2t", rows.i2t, rows.lse_i2t), ("t2i", rows.t2i, rows.lse_t2i)):
        g, u_new = estimator_update(u[name][index], lse, shift, gamma_u)
        weight = g / u_new  # each row's softmax weighted by g_i / u_i
        objective = objective + (loss.double() + (weight - 1.0) * lse.double()).mean()
        updated[name] = u_new
    return 0.5 * objective, updated


def fastclip_step(model, images, captions, index, u, *, tau, gamma, gamma_u, backend="auto"):
    """(the step's objective, each direction's updated u of the batch, also written into ``u``;
    the batch's plain loss mean ½(i2t + t2i)), leaving the tower gradients in ``model``. float32
    features through the fused loss."""
    img, txt = model(images[index], captions[index])
    rows = hn_clip_loss(img, txt, tau, gamma=gamma, reduction="directions", backend=backend)
    objective, updated = step_objective(rows, u, index, shift=(1.0 + gamma) / tau, gamma_u=gamma_u)
    model.zero_grad()
    objective.backward()
    for name, u_new in updated.items():
        u[name][index] = u_new
    return objective.detach(), updated, 0.5 * (rows.i2t + rows.t2i).detach().mean()


def materialised_step(model, images, captions, index, u, *, tau, gamma, gamma_u):
    """The same step in float64 with the logits materialised: (objective, {parameter name: grad},
    each direction's updated u). Z = (v̂ t̂ᵀ + γ·sg(t̂ t̂ᵀ)·(1 − I))/τ, LSE by logsumexp, Z_pos its
    diagonal; nothing of the package is used."""
    towers = {name: p.detach().double().clone().requires_grad_(True) for name, p in model.named_parameters()}
    x, y = images[index].double(), captions[index].double()
    v = F.normalize(x @ towers["image.weight"].T + towers["image.bias"], dim=1)
    t = F.normalize(y @ towers["text.weight"].T + towers["text.bias"], dim=1)
    off = 1.0 - torch.eye(v.shape[0], dtype=torch.float64)
    z = (v @ t.T + gamma * (t @ t.T).detach() * off) / tau
    z_t2i = (t @ v.T + gamma * (t @ t.T).detach() * off) / tau
    shift = (1.0 + gamma) / tau
    objective, updated = 0.0, {}
    for name, logits in (("i2t", z), ("t2i", z_t2i)):
        lse = torch.logsumexp(logits, dim=1)
        g, u_new = estimator_update(u[name][index], lse, shift, gamma_u)
        objective = objective + ((g / u_new) * lse - logits.diagonal()).mean()
        updated[name] = u_new
    objective = 0.5 * objective
    grads = torch.autograd.grad(objective, list(towers.values()))
    return objective.detach(), dict(zip(towers, grads)), updated


def check_step(backend: str = "auto", *, tau: float = 0.07, gamma: float = 0.5, gamma_u: float = 0.8, seed: int = 0):
    """Relative errors of one fused step against the materialised float64 one, after a first
    step has set u (so the second visit's moving average is exercised): {"objective", "d <param>",
    "u i2t", "u t2i"}."""
    images, captions = toy_data(seed)
    model = Towers(seed)
    u = {name: torch.zeros(N_SAMPLES, dtype=torch.float64) for name in ("i2t", "t2i")}
    first = torch.arange(BATCH)
    fastclip_step(model, images, captions, first, u, tau=tau, gamma=gamma, gamma_u=gamma_u, backend=backend)
    index = torch.arange(BATCH // 2, BATCH // 2 + BATCH)  # half seen before, half new
    u_before = {k: x.clone() for k, x in u.items()}
    want, want_grads, want_u = materialised_step(
        model, images, captions, index, u_before, tau=tau, gamma=gamma, gamma_u=gamma_u
    )
    got, got_u, _ = fastclip_step(
        model, images, captions, index, u, tau=tau, gamma=gamma, gamma_u=gamma_u, backend=backend
    )
    errs = {"objective": (abs(got - want) / abs(want)).item()}
    for name, p in model.named_parameters():
        errs[f"d {name}"] = ((p.grad.double() - want_grads[name]).norm() / want_grads[name].norm()).item()
    for name in ("i2t", "t2i"):
        errs[f"u {name}"] = ((got_u[name] - want_u[name]).abs() / want_u[name]).max().item()
    return errs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--tau", type=float, default=0.07)
    parser.add_argument("--gamma", type=float, default=0.5)
    parser.add_argument("--gamma-u", type=float, default=0.8)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args(argv)
    errs = check_step(args.backend, tau=args.tau, gamma=args.gamma, gamma_u=args.gamma_u)
    worst = max(errs.values())
    print("check: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()) + f" (tolerance {TOL:.0e})")
    images, captions = toy_data()
    model = Towers()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    u = {name: torch.zeros(N_SAMPLES, dtype=torch.float64) for name in ("i2t", "t2i")}
    order = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(1))
    for step in range(args.steps):
        index = order[(step * BATCH) % N_SAMPLES :][:BATCH]
        objective, _, batch_loss = fastclip_step(
            model, images, captions, index, u, tau=args.tau, gamma=args.gamma, gamma_u=args.gamma_u,
            backend=args.backend,
        )  # fmt: skip
        opt.step()
        seen = u["i2t"] > 0
        print(
            f"step {step}: objective {objective.item():.4f}, batch loss {batch_loss.item():.4f}, "
            f"samples with an estimate {int(seen.sum())}"
        )
    return 0 if worst <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())
