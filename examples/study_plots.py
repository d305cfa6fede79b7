"""The figure of ``fine_tune_study.py``, from a run's CSVs: the regime per epoch and R@1 per arm.

    python examples/study_plots.py [DIR] [--png PATH]   # default: the committed run, DIR/study.png

Four panels: (a) per epoch, the fraction of directional rows whose float32 positive-logit
gradient rounds to 0 and (b) the median batch InfoNCE, each arm's own training batches, epoch 0
the initialisation; (c) each arm's held-out R@1 at the last epoch, t→i and i→t, with the
crossed model's 95% intervals (``study_stats.crossed_t``); (d) Δ R@1 against ClipLoss (the siglip
arm set: each comparison of its family, arm − reference) with the same intervals, a filled marker where the difference is detected (Holm p < 0.05 over the family).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import study_stats as st  # noqa: E402
import study_tables as tb  # noqa: E402

DIRECTIONS = (("t2i_R@1", "t→i", "o"), ("i2t_R@1", "i→t", "s"))


def _per_epoch(regime: list, arm: str, key: str) -> tuple:
    epochs = sorted({int(r["epoch"]) for r in regime if r["arm"] == arm})
    means = []
    for e in epochs:
        vals = [float(r[key]) for r in regime if r["arm"] == arm and int(r["epoch"]) == e]
        means.append(sum(vals) / len(vals))
    return epochs, means


def _interval(ax, i, j, x, marker, label, filled=True):
    """Arm i's mean and 95% interval ``x`` (a crossed_t result) for direction j, beside the other direction."""
    ax.errorbar(
        i + 0.15 * (2 * j - 1),
        x["mean"],
        yerr=[[x["mean"] - x["low"]], [x["high"] - x["mean"]]],
        fmt=marker,
        color=f"C{j}",
        mfc=f"C{j}" if filled else "white",
        capsize=3,
        label=label if i == 0 else None,
    )


def plot(folder: str, path: str) -> str:
    """Writes the figure of the run in ``folder`` to ``path`` (PNG); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = tb.load(folder)
    arms, regime, final = data["run"]["arms"], data["regime"], data["final"]
    colors = {arm: f"C{i}" for i, arm in enumerate(arms)}
    start = {key: _per_epoch(regime, tb.INIT_ARM, key)[1][0] for key in ("fp32_zero_pos_grad_rows", "median_infonce")}
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    for ax, key, title in (
        (axes[0, 0], "fp32_zero_pos_grad_rows", "(a) rows whose float32 positive-logit gradient rounds to 0"),
        (axes[0, 1], "median_infonce", "(b) median batch InfoNCE (float32)"),
    ):
        for arm in arms:
            epochs, means = _per_epoch(regime, arm, key)
            ax.plot([0] + epochs, [start[key]] + means, "-o", ms=3, color=colors[arm], label=arm)
        ax.set_xticks([0] + epochs)
        ax.set(title=title, xlabel="epoch (0: the initialisation, no update)")
        ax.grid(alpha=0.3)
    axes[0, 1].set_yscale("log")
    axes[0, 0].legend(fontsize=7)

    by = {(r["arm"], tb._key(r)): r for r in final}
    cells = tb.grid(final)
    names = [tb.INIT_ARM] + arms
    ax = axes[1, 0]
    for j, (metric, label, marker) in enumerate(DIRECTIONS):
        for i, arm in enumerate(names):
            _interval(ax, i, j, st.crossed_t({k: float(by[(arm, k)][metric]) for k in cells}), marker, label)
    ax.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=7, rotation=20)
    ax.set(title="(c) held-out R@1 at the last epoch (95%, crossed model)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)

    ax = axes[1, 1]
    which = tb.arm_set(data)
    rows = {(r["arm"], r["ref"], r["metric"]): r for r in tb.data_comparisons(data)}
    pairs = tb.family(arms, which)  # the main arm set: every arm against ClipLoss
    for j, (metric, label, marker) in enumerate(DIRECTIONS):
        for i, (arm, ref) in enumerate(pairs):
            r = rows[(arm, ref, metric)]
            _interval(ax, i, j, r["x"], marker, label, filled=tb._detected(r))
    ax.axhline(0.0, color="k", lw=0.8)
    names = [tb.pair_name(dict(arm=a, ref=r), which).replace(", ", ",\n") for a, r in pairs]
    ax.set_xticks(range(len(pairs)), names, fontsize=7, rotation=20)
    what = "Δ R@1 − ClipLoss" if which == "main" else "Δ R@1, arm − reference"
    ax.set(title=f"(d) {what} (95%, crossed model; filled: Holm p < 0.05)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(f"fine-tuning study: {tb.label(data)}, {tb.design(data)[2]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", default=tb.COMMITTED)
    ap.add_argument("--png", default=None, help="default: FOLDER/study.png")
    a = ap.parse_args(argv)
    print(plot(a.folder, a.png or os.path.join(a.folder, "study.png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
