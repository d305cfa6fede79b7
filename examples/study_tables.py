"""The tables and conclusions of ``fine_tune_study.py``, from its CSVs (``final.csv``, ``regime.csv``,
``stage1.csv``, ``run.json``).

    python examples/study_tables.py [DIR]            # every table of a run's output (default: the committed run)
    python examples/study_tables.py --emit NAME      # one table of the committed run (tools.docs_tables calls this)

The committed run is ``examples/results/fine_tune_study/``; the docs' generated regions
``study-*`` (docs/studies.md, README.md) are these tables, checked by tests/docs/test_tables.py.
Every sentence here is computed from the CSVs; nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import study_stats as st  # noqa: E402

COMMITTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fine_tune_study")
REPLICATION = COMMITTED + "_replication"  # the same protocol on fresh initialisations and seeds
BASE, INIT_ARM = "ClipLoss", "initialisation"
METRICS = ("t2i_R@1", "i2t_R@1", "t2i_group_acc", "i2t_group_acc")
LABEL = {"t2i_R@1": "t→i R@1", "i2t_R@1": "i→t R@1", "t2i_group_acc": "t→i group acc", "i2t_group_acc": "i→t group acc"}
PRIMARY = ("HN-CLIP", "t2i_R@1")
ALPHA = 0.05


def load(folder: str) -> dict:
    def rows(name):
        with open(os.path.join(folder, name), newline="") as fh:
            return list(csv.DictReader(fh))

    with open(os.path.join(folder, "run.json")) as fh:
        run = json.load(fh)
    return dict(final=rows("final.csv"), regime=rows("regime.csv"), stage1=rows("stage1.csv"), run=run)


def _key(r) -> tuple:
    return int(r["init"]), int(r["seed"])


def comparisons(final: list, arms: list) -> list:
    """Every arm × metric against ClipLoss, paired within (init, seed), Holm over the family."""
    by = {(r["arm"], _key(r)): r for r in final}
    keys = sorted({_key(r) for r in final if r["arm"] == BASE})
    out = []
    for arm in [a for a in arms if a != BASE]:
        for metric in METRICS:
            diffs = [float(by[(arm, k)][metric]) - float(by[(BASE, k)][metric]) for k in keys]
            clusters = {}
            for k, d in zip(keys, diffs):
                clusters.setdefault(k[0], []).append(d)
            t, c, s = st.paired_t(diffs), st.cluster_t(clusters), st.sign_test(diffs)
            out.append(dict(arm=arm, metric=metric, t=t, cluster=c, sign=s, mdd=st.min_detectable(t["sd"], t["n"])))
    for row, p in zip(out, st.holm([r["t"]["p"] for r in out])):
        row["holm_p"] = p
    primary = [r for r in out if (r["arm"], r["metric"]) == PRIMARY]
    return primary + [r for r in out if (r["arm"], r["metric"]) != PRIMARY]


def _num(x: float, sign: bool = True) -> str:
    s = f"{x:+.3f}" if sign else f"{x:.3f}"
    return s.replace("-", "−")


def _p(p: float) -> str:
    if math.isnan(p):
        return "–"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def _detected(r) -> bool:
    return not math.isnan(r["holm_p"]) and r["holm_p"] < ALPHA


def _relation(r) -> str:
    return "ahead of" if r["t"]["mean"] > 0 else "behind"


def verdict(r) -> str:
    if _detected(r):
        return "ahead" if r["t"]["mean"] > 0 else "behind"
    return f"none detected (MDD {r['mdd']:.3f})"


def md_table(header, rows) -> str:
    line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(r) for r in rows])


def design(data: dict) -> tuple:
    """(k initialisations, n pairs, "k initialisations × m seeds" or the pairs of an incomplete run)."""
    keys = {_key(r) for r in data["final"] if r["arm"] == BASE}
    inits, seeds = {i for i, _ in keys}, {s for _, s in keys}
    if len(keys) == len(inits) * len(seeds):
        return len(inits), len(keys), f"{len(inits)} initialisations × {len(seeds)} seeds"
    return len(inits), len(keys), f"{len(keys)} (initialisation, seed) pairs of {len(inits)} initialisations"


def results_table(data: dict) -> str:
    """The paired comparisons, primary first, with the design line above them."""
    run, rows = data["run"], comparisons(data["final"], data["run"]["arms"])
    k, n, what = design(data)
    head = (
        f"{what} = {n} pairs; held-out pool {run['held_out_pairs']} pairs "
        f"per seed; last epoch ({run['config']['epochs']}). Δ = arm − ClipLoss within each (initialisation, seed): "
        f"mean [95% paired t-interval, {n - 1} df], the interval over the {k} initialisations' means "
        f"({k - 1} df, carries initialisation variance), wins/losses/ties with the exact sign-test p, the paired "
        f"t-test's p Holm-adjusted over all {len(rows)} comparisons, and the verdict at Holm p < {ALPHA} "
        f"(MDD: the smallest |Δ| detectable with 80% power at α = {ALPHA})."
    )
    body = []
    for r in rows:
        t, c, s = r["t"], r["cluster"], r["sign"]
        name = f"**{r['arm']}**" if (r["arm"], r["metric"]) == PRIMARY else r["arm"]
        metric = f"**{LABEL[r['metric']]}** (primary)" if (r["arm"], r["metric"]) == PRIMARY else LABEL[r["metric"]]
        body.append(
            [
                name,
                metric,
                f"{_num(t['mean'])} [{_num(t['low'])}, {_num(t['high'])}]",
                f"[{_num(c['low'])}, {_num(c['high'])}]",
                f"{s['wins']}/{s['losses']}/{s['ties']}, p {_p(s['p']) if s['p'] < 0.001 else '= ' + _p(s['p'])}",
                _p(r["holm_p"]),
                verdict(r),
            ]
        )
    table = md_table(
        ["arm vs ClipLoss", "metric", "Δ [95% t]", "Δ by initialisation", "W/L/T, sign p", "Holm p", "verdict"], body
    )
    return head + "\n\n" + table


def levels_table(data: dict) -> str:
    """Each arm's mean over the pairs (± half-width of the 95% t-interval) and the initialisation's."""
    final, arms = data["final"], [INIT_ARM] + data["run"]["arms"]
    body = []
    for arm in arms:
        rows = [r for r in final if r["arm"] == arm]
        cells = []
        for m in METRICS:
            t = st.paired_t([float(r[m]) for r in rows])
            cells.append(f"{t['mean']:.3f} ± {t['high'] - t['mean']:.3f}")
        tau = sum(float(r["tau"]) for r in rows) / len(rows)
        body.append([arm + (" (epoch 0)" if arm == INIT_ARM else "")] + cells + [f"{tau:.4f}"])
    for arm, why in data["run"].get("missing", {}).items():
        body.append([arm, f"not run: {why}"] + [""] * len(METRICS))
    table = md_table(["arm"] + [LABEL[m] for m in METRICS] + ["τ"], body)
    by = {(r["arm"], _key(r)): r for r in final}
    keys = sorted({_key(r) for r in final if r["arm"] == BASE})
    parts = []
    for arm in data["run"]["arms"]:
        t = st.paired_t([float(by[(arm, k)]["t2i_R@1"]) - float(by[(INIT_ARM, k)]["t2i_R@1"]) for k in keys])
        where = "below" if t["high"] < 0 else "above" if t["low"] > 0 else "not distinguishable from"
        parts.append(f"{arm} {_num(t['mean'])} [{_num(t['low'])}, {_num(t['high'])}], {where} it")
    line = (
        "Against the initialisation (descriptive, outside the Holm family), the last epoch's t→i R@1 − epoch 0's, "
        "paired within (initialisation, seed), mean [95% t-interval]: " + "; ".join(parts) + "."
    )
    return table + "\n\n" + line


def regime_table(data: dict) -> str:
    """Per arm and epoch, over all pairs: batches with InfoNCE < 1e-3 / zero-gradient rows."""
    regime, arms = data["regime"], data["run"]["arms"]
    epochs = sorted({int(r["epoch"]) for r in regime})
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    body = []
    start = [r for r in regime if r["arm"] == INIT_ARM]
    body.append(
        ["initialisation (no update)"]
        + [
            f"{mean([float(r['sat_batches']) for r in start]):.2f} / {mean([float(r['fp32_zero_pos_grad_rows']) for r in start]):.2f}"
        ]
        + [""] * (len(epochs) - 1)
        + [f"{mean([float(r['median_infonce']) for r in start]):.3f}"]
    )
    for arm in arms:
        cells = []
        for e in epochs[1:]:
            rows = [r for r in regime if r["arm"] == arm and int(r["epoch"]) == e]
            cells.append(
                f"{mean([float(r['sat_batches']) for r in rows]):.2f} / {mean([float(r['fp32_zero_pos_grad_rows']) for r in rows]):.2f}"
            )
        first = [r for r in regime if r["arm"] == arm and int(r["epoch"]) == 1]
        body.append([arm, ""] + cells + [f"{mean([float(r['median_infonce']) for r in first]):.3f}"])
    header = ["arm"] + [f"epoch {e}" for e in epochs] + ["median batch InfoNCE (first row epoch 0, arms epoch 1)"]
    sat0 = mean([float(r["sat_batches"]) for r in start])
    clip = [r for r in regime if r["arm"] == BASE]
    best = max(mean([float(r["sat_batches"]) for r in clip if int(r["epoch"]) == e]) for e in epochs[1:])
    zero0 = mean([float(r["fp32_zero_pos_grad_rows"]) for r in start])
    sentence = (
        f"Batches with InfoNCE < 1e-3 / rows with an exactly-zero float32 positive gradient, mean over the "
        f"{len(start)} (initialisation, seed) pairs. At the start of fine-tuning {sat0:.0%} of the batches are below "
        f"1e-3 (target ≥ 50%, paper 80%): the target is "
        + ("reached" if sat0 >= 0.5 else "not reached")
        + f"; ClipLoss's best epoch has {best:.0%}. Zero-gradient rows at the start: {zero0:.0%} (paper: 47%)."
    )
    return sentence + "\n\n" + md_table(header, body)


def run_table(data: dict) -> str:
    """Stage 1 per initialisation, the leakage check and the run's cost."""
    run = data["run"]
    body = [
        [
            str(r["init"]),
            str(r["steps"]),
            f"{float(r['t2i_R@1']):.3f} / {float(r['i2t_R@1']):.3f}",
            f"{float(r['logit_scale']):.1f}",
            f"{float(r['cpu_seconds']):.0f}",
        ]
        for r in run["stage1"]
    ]
    table = md_table(
        ["initialisation", "stage-1 steps", "stage-1 held-out R@1 t→i / i→t", "learned s", "CPU s (when trained)"],
        body,
    )
    leak = run["leakage"]
    cfg = run["config"]
    lines = [
        table,
        "",
        f"Leakage check (asserted by the run): {leak['held_out_scenes']} held-out scenes "
        f"({leak['held_out_captions']} distinct captions; stage 1's held-out set and every seed's pool) against "
        f"{leak['training_scenes']} training scenes ({leak['training_captions']} distinct captions; stage 1 of "
        f"every initialisation and every seed's pool): {leak['shared_captions']} captions and "
        f"{leak['shared_scenes']} scenes shared.",
        "",
        f"Run: stage-1 width {cfg['width']}, {cfg['s1_train']} scenes; pool {run['pool_pairs']} pairs, "
        f"{cfg['epochs']} epochs, lr {cfg['lr']}; {cfg['threads']} torch thread; {run['cpu_seconds'] / 60:.1f} "
        f"CPU-minutes (user+sys) and {run['wall_seconds'] / 60:.1f} minutes wall, stage 1 included where trained "
        f"(load average {run['load_average_at_start']} at the start); {run['cpu']}, torch {run['torch']}.",
    ]
    if not run.get("complete", True):
        done = len({_key(r) for r in data["final"]})
        lines.append(
            f"\n**Incomplete run**: stopped after {done} of {len(run['inits']) * run['config']['seeds']} "
            "(initialisation, seed) pairs; every table uses the pairs that finished."
        )
    return "\n".join(lines)


def conclusions(data: dict) -> str:
    """The sentences of conclusion, each computed from the comparisons."""
    rows = comparisons(data["final"], data["run"]["arms"])
    p = rows[0]
    t, c = p["t"], p["cluster"]
    k = design(data)[0]
    across = "excludes" if (c["low"] > 0 or c["high"] < 0) else "includes"
    out = [
        f"- Primary (HN-CLIP γ = 0.5 − ClipLoss, t→i R@1): Δ = {_num(t['mean'])} "
        f"[{_num(t['low'])}, {_num(t['high'])}] over {t['n']} pairs, Holm p = {_p(p['holm_p'])}: "
        + (
            f"HN-CLIP is {_relation(p)} ClipLoss."
            if _detected(p)
            else f"no difference detected; the smallest difference this run could detect is ±{p['mdd']:.3f}."
        )
        + f" The interval over the {k} initialisations' means, [{_num(c['low'])}, {_num(c['high'])}], {across} 0."
    ]
    found = [r for r in rows[1:] if _detected(r)]
    for r in found:
        c = r["cluster"]
        across = "excludes" if (c["low"] > 0 or c["high"] < 0) else "includes"
        out.append(
            f"- {r['arm']} is {_relation(r)} ClipLoss on {LABEL[r['metric']]}: Δ = {_num(r['t']['mean'])} "
            f"[{_num(r['t']['low'])}, {_num(r['t']['high'])}], Holm p = {_p(r['holm_p'])}; the interval over "
            f"initialisations {across} 0."
        )
    none = [r for r in rows[1:] if not _detected(r)]
    if none:
        parts = [f"{r['arm']} on {LABEL[r['metric']]} (MDD {r['mdd']:.3f})" for r in none]
        out.append("- No difference detected (Holm p ≥ 0.05) for: " + "; ".join(parts) + ".")
    return "\n".join(out)


def readme_table(data: dict, rep: dict = None) -> str:
    """The README's short version: every arm on the primary metric (and, given ``rep``, the
    replication's verdict), then what the other metrics show."""
    every = comparisons(data["final"], data["run"]["arms"])
    rows = [r for r in every if r["metric"] == PRIMARY[1]]
    again = {(r["arm"], r["metric"]): r for r in comparisons(rep["final"], rep["run"]["arms"])} if rep else {}
    body = [
        [
            r["arm"] + (" (primary)" if (r["arm"], r["metric"]) == PRIMARY else ""),
            f"{_num(r['t']['mean'])} [{_num(r['t']['low'])}, {_num(r['t']['high'])}]",
            f"{r['sign']['wins']}/{r['sign']['losses']}/{r['sign']['ties']}",
            _p(r["holm_p"]),
            verdict(r),
        ]
        + (
            [f"{_num(again[(r['arm'], r['metric'])]['t']['mean'])}: {verdict(again[(r['arm'], r['metric'])])}"]
            if rep
            else []
        )
        for r in rows
    ]
    head = (
        f"Δ t→i R@1 against ClipLoss at the last epoch, {design(data)[2]} "
        f"(mean [95% paired t-interval], wins/losses/ties, Holm p over all {len(every)} comparisons):"
    )
    others = [r for r in every if r["metric"] != PRIMARY[1] and _detected(r)]
    tail = "In the default run, on the other metrics (i→t R@1, group accuracy both ways), " + (
        "differences are detected for: "
        + "; ".join(f"{r['arm']} {verdict(r)} on {LABEL[r['metric']]} ({_num(r['t']['mean'])})" for r in others)
        + "; none for the rest."
        if others
        else "no difference is detected."
    )
    header = ["arm vs ClipLoss", "Δ", "W/L/T", "Holm p", "verdict"] + (
        [f"replication ({design(rep)[2]}, fresh): Δ, verdict"] if rep else []
    )
    return head + "\n\n" + md_table(header, body) + "\n\n" + tail


def replication_table(data: dict, rep: dict) -> str:
    """The primary comparison and every one detected in either run, in the default run and in the
    replication (fresh initialisations and seeds, the same protocol)."""
    first = comparisons(data["final"], data["run"]["arms"])
    again = {(r["arm"], r["metric"]): r for r in comparisons(rep["final"], rep["run"]["arms"])}
    rows = [
        r
        for r in first
        if (r["arm"], r["metric"]) == PRIMARY or _detected(r) or _detected(again[(r["arm"], r["metric"])])
    ]

    def cell(r):
        t = r["t"]
        return f"{_num(t['mean'])} [{_num(t['low'])}, {_num(t['high'])}], Holm p {_p(r['holm_p'])}: {verdict(r)}"

    body = []
    for r in rows:
        q = again[(r["arm"], r["metric"])]
        same = _detected(r) == _detected(q) and (not _detected(r) or (r["t"]["mean"] > 0) == (q["t"]["mean"] > 0))
        body.append([r["arm"], LABEL[r["metric"]], cell(r), cell(q), "yes" if same else "no"])
    found = [r for r in first if _detected(r)]
    held = [
        r
        for r in found
        if _detected(again[(r["arm"], r["metric"])])
        and (r["t"]["mean"] > 0) == (again[(r["arm"], r["metric"])]["t"]["mean"] > 0)
    ]
    new = [
        q
        for q in again.values()
        if _detected(q) and not _detected(next(r for r in first if (r["arm"], r["metric"]) == (q["arm"], q["metric"])))
    ]
    _, _, what = design(rep)
    head = (
        f"The replication: the same script and protocol on fresh initialisations {min(rep['run']['inits'])}–"
        f"{max(rep['run']['inits'])} and seeds {min(rep['run']['seeds'])}–{max(rep['run']['seeds'])} ({what}). "
        f"Of the {len(found)} differences the default run detects, {len(held)} are detected again with the same sign; "
        f"the replication detects {len(new)} the default run does not."
    )
    return head + "\n\n" + md_table(["arm vs ClipLoss", "metric", "default run", "replication", "same verdict"], body)


TABLES = {
    "study-results": lambda d: results_table(d) + "\n\n" + conclusions(d),
    "study-levels": levels_table,
    "study-regime": regime_table,
    "study-run": run_table,
    "study-readme": lambda d: readme_table(d, load(REPLICATION)),
    "study-replication": lambda d: replication_table(d, load(REPLICATION)),
}
ONE_RUN = dict(TABLES, **{"study-readme": readme_table})  # what one run's output alone gives
del ONE_RUN["study-replication"]


def render_all(folder: str) -> str:
    """Every table of one run (the replication table compares the two committed runs: not here)."""
    data = load(folder)
    return "\n\n".join(f"## {name}\n\n{make(data)}" for name, make in ONE_RUN.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", default=COMMITTED)
    ap.add_argument("--emit", choices=sorted(TABLES), help="print one table")
    a = ap.parse_args(argv)
    if a.emit:
        print(TABLES[a.emit](load(a.folder)))
    elif a.folder == COMMITTED:  # the committed runs: every region of the docs
        data = load(a.folder)
        print("\n\n".join(f"## {name}\n\n{make(data)}" for name, make in TABLES.items()))
    else:
        print(render_all(a.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
