"""The tables and conclusions of ``fine_tune_study.py``, from its CSVs (``final.csv``, ``regime.csv``,
``stage1.csv``, ``run.json``).

    python examples/study_tables.py [DIR]            # every table of a run's output (default: the committed run)
    python examples/study_tables.py --emit NAME      # one table of the committed run (tools.docs_tables calls this)

The committed runs are ``examples/results/fine_tune_study/`` (and its ``_replication``) and, for the
``study-siglip-*`` tables, ``examples/results/fine_tune_study_siglip/`` (``--arm-set siglip``); the
docs' generated regions ``study-*`` (docs/studies.md, README.md) are these tables, checked by
tests/docs/test_tables.py.
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
SIGLIP = COMMITTED + "_siglip"  # --arm-set siglip: ClipLoss, SigLIP, HN-SigLIP
BASE, INIT_ARM = "ClipLoss", "initialisation"
METRICS = ("t2i_R@1", "i2t_R@1", "t2i_group_acc", "i2t_group_acc")
LABEL = {"t2i_R@1": "t→i R@1", "i2t_R@1": "i→t R@1", "t2i_group_acc": "t→i group acc", "i2t_group_acc": "i→t group acc"}
PRIMARY = ("HN-CLIP", "t2i_R@1")
# per arm set: the family's (arm, reference) pairs (None: every arm against ClipLoss) and the primary
FAMILIES = {
    "main": dict(pairs=None, primary=("HN-CLIP", BASE, "t2i_R@1")),
    "siglip": dict(
        pairs=[("HN-SigLIP", "SigLIP"), ("SigLIP", BASE), ("HN-SigLIP", BASE)],
        primary=("HN-SigLIP", "SigLIP", "t2i_R@1"),
    ),
}
ALPHA = 0.05


def load(folder: str) -> dict:
    def rows(name):
        with open(os.path.join(folder, name), newline="") as fh:
            return list(csv.DictReader(fh))

    with open(os.path.join(folder, "run.json")) as fh:
        run = json.load(fh)
    regime = rows("regime.csv")
    for r in regime:  # version 4 named the same quantity zero_grad_rows
        if "zero_grad_rows" in r:
            r["fp32_zero_pos_grad_rows"] = r.pop("zero_grad_rows")
    return dict(final=rows("final.csv"), regime=regime, stage1=rows("stage1.csv"), run=run, folder=folder)


def arm_set(data: dict) -> str:
    """The run's arm set (``--arm-set``; runs before it have the main one)."""
    return data["run"].get("arm_set", "main")


def label(data: dict) -> str:
    """What the tables call a run: the two committed runs by name, any other by its folder."""
    where = os.path.realpath(data["folder"])
    if where == os.path.realpath(COMMITTED):
        return "the default run"
    if where == os.path.realpath(REPLICATION):
        return "the replication"
    if where == os.path.realpath(SIGLIP):
        return "the SigLIP run"
    return f"the run in `{data['folder']}`"


def _key(r) -> tuple:
    return int(r["init"]), int(r["seed"])


def grid(final: list) -> list:
    """The (initialisation, seed) cells of the complete seeds: every initialisation ran them.

    A run stopped early (seeds are its outer loop) keeps its finished seeds; the crossed model
    needs the complete grid."""
    keys = {_key(r) for r in final if r["arm"] == BASE}
    inits = {i for i, _ in keys}
    seeds = [s for s in sorted({s for _, s in keys}) if all((i, s) in keys for i in inits)]
    return [(i, s) for i in sorted(inits) for s in seeds]


def family(arms: list, which: str = "main") -> list:
    """The (arm, reference) pairs an arm set compares: the main one every arm against ClipLoss, the
    siglip one HN-SigLIP against SigLIP (its primary) and each sigmoid arm against ClipLoss."""
    pairs = FAMILIES[which]["pairs"]
    if pairs is None:
        return [(a, BASE) for a in arms if a != BASE]
    return [(a, ref) for a, ref in pairs if a in arms and ref in arms]


def is_primary(r: dict, which: str = "main") -> bool:
    return (r["arm"], r["ref"], r["metric"]) == FAMILIES[which]["primary"]


def comparisons(final: list, arms: list, which: str = "main") -> list:
    """Every (arm, reference) pair of the arm set's family (:func:`family`) × metric, paired within each
    (init, seed) cell, under the crossed two-way random-effects model (``study_stats.crossed_t``); Holm
    over the family; the primary first."""
    by = {(r["arm"], _key(r)): r for r in final}
    keys = grid(final)
    out = []
    for arm, ref in family(arms, which):
        for metric in METRICS:
            diffs = {k: float(by[(arm, k)][metric]) - float(by[(ref, k)][metric]) for k in keys}
            x, s = st.crossed_t(diffs), st.sign_test(list(diffs.values()))
            mdd = st.min_detectable_se(x["se"], x["df"])
            out.append(dict(arm=arm, ref=ref, metric=metric, x=x, sign=s, mdd=mdd))
    for row, p in zip(out, st.holm([r["x"]["p"] for r in out])):
        row["holm_p"] = p
    return [r for r in out if is_primary(r, which)] + [r for r in out if not is_primary(r, which)]


def data_comparisons(data: dict) -> list:
    """:func:`comparisons` of a loaded run, for its arm set."""
    return comparisons(data["final"], data["run"]["arms"], arm_set(data))


def pair_name(r: dict, which: str = "main") -> str:
    """A comparison's name in the tables: the arm (main: every one against ClipLoss), or "arm − reference"."""
    return r["arm"] if which == "main" else f"{r['arm']} − {r['ref']}"


def _num(x: float, sign: bool = True) -> str:
    s = f"{x:+.3f}" if sign else f"{x:.3f}"
    return s.replace("-", "−")


def _p(p: float) -> str:
    if math.isnan(p):
        return "–"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def _p_is(p: float) -> str:
    """ "= 0.012" or "< 0.001", for after "p"."""
    text = _p(p)
    return text if text.startswith("<") else "= " + text


def _detected(r) -> bool:
    return not math.isnan(r["holm_p"]) and r["holm_p"] < ALPHA


def _relation(r) -> str:
    return "ahead of" if r["x"]["mean"] > 0 else "behind"


def verdict(r) -> str:
    if _detected(r):
        return "ahead" if r["x"]["mean"] > 0 else "behind"
    return f"none detected (MDD {r['mdd']:.3f})"


def md_table(header, rows) -> str:
    line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(r) for r in rows])


def design(data: dict) -> tuple:
    """(k initialisations, n cells, "k initialisations × m seeds", with the cells left out of an incomplete run)."""
    keys = {_key(r) for r in data["final"] if r["arm"] == BASE}
    cells = grid(data["final"])
    inits, seeds = {i for i, _ in cells}, {s for _, s in cells}
    what = f"{len(inits)} initialisations × {len(seeds)} seeds"
    if len(keys) > len(cells):
        what += f" (the complete seeds; {len(keys) - len(cells)} cells of an unfinished seed left out)"
    return len(inits), len(cells), what


def shared(data: dict) -> str:
    """What the cells of one seed share, by the run's version (5: fresh pools per cell)."""
    if data["run"].get("version", 4) >= 5:
        return (
            "the seed's held-out pool (a training pool and batch order per cell; held-out pools disjoint across seeds)"
        )
    return "the seed's training pool, batch order and held-out pool"


def results_table(data: dict) -> str:
    """The paired comparisons, primary first, with the design line above them."""
    run, rows, which = data["run"], data_comparisons(data), arm_set(data)
    k, n, what = design(data)
    delta = (
        "Δ = arm − ClipLoss"
        if which == "main"
        else "Δ = arm − reference (HN-SigLIP − SigLIP, the primary; each sigmoid arm − ClipLoss)"
    )
    head = (
        f"{what} = {n} cells; held-out pool {run['held_out_pairs']} pairs per seed; last epoch "
        f"({run['config']['epochs']}). The design is crossed: an initialisation is shared by its seeds, and a seed's "
        f"cells share {shared(data)}. {delta} within each cell: mean [95% interval of the crossed two-way "
        f"random-effects model, initialisation × seed both random, Satterthwaite df], the components' sds "
        f"(initialisation / seed / cell), wins/losses/ties with the exact sign-test p (descriptive: it treats the "
        f"cells as independent), the model's p Holm-adjusted over all {len(rows)} comparisons, and the verdict at "
        f"Holm p < {ALPHA} (MDD: the smallest |Δ| the model's test detects with 80% power at α = {ALPHA})."
    )
    body = []
    for r in rows:
        t, s = r["x"], r["sign"]
        name = f"**{pair_name(r, which)}**" if is_primary(r, which) else pair_name(r, which)
        metric = f"**{LABEL[r['metric']]}** (primary)" if is_primary(r, which) else LABEL[r["metric"]]
        body.append(
            [
                name,
                metric,
                f"{_num(t['mean'])} [{_num(t['low'])}, {_num(t['high'])}]",
                f"{t['df']:.1f}",
                f"{t['sd_init']:.3f} / {t['sd_seed']:.3f} / {t['sd_cell']:.3f}",
                f"{s['wins']}/{s['losses']}/{s['ties']}, p {_p_is(s['p'])}",
                _p(r["holm_p"]),
                verdict(r),
            ]
        )
    table = md_table(
        ["arm vs ClipLoss" if which == "main" else "comparison"]
        + ["metric", "Δ [95%]", "df", "sd init / seed / cell", "W/L/T, sign p", "Holm p", "verdict"],
        body,
    )
    return head + "\n\n" + table


def levels_table(data: dict) -> str:
    """Each arm's mean over the cells (± half-width of the crossed model's 95% interval) and the initialisation's."""
    final, arms = data["final"], [INIT_ARM] + data["run"]["arms"]
    by = {(r["arm"], _key(r)): r for r in final}
    keys = grid(final)
    body = []
    for arm in arms:
        rows = [by[(arm, k)] for k in keys]
        cells = []
        for m in METRICS:
            t = st.crossed_t({k: float(by[(arm, k)][m]) for k in keys})
            cells.append(f"{t['mean']:.3f} ± {t['high'] - t['mean']:.3f}")
        tau = sum(float(r["tau"]) for r in rows) / len(rows)
        body.append([arm + (" (epoch 0)" if arm == INIT_ARM else "")] + cells + [f"{tau:.4f}"])
    for arm, why in data["run"].get("missing", {}).items():
        body.append([arm, f"not run: {why}"] + [""] * len(METRICS))
    table = md_table(["arm"] + [LABEL[m] for m in METRICS] + ["τ"], body)
    parts = []
    for arm in data["run"]["arms"]:
        t = st.crossed_t({k: float(by[(arm, k)]["t2i_R@1"]) - float(by[(INIT_ARM, k)]["t2i_R@1"]) for k in keys})
        where = "below" if t["high"] < 0 else "above" if t["low"] > 0 else "not distinguishable from"
        parts.append(f"{arm} {_num(t['mean'])} [{_num(t['low'])}, {_num(t['high'])}], {where} it")
    line = (
        "Against the initialisation (descriptive, outside the Holm family), the last epoch's t→i R@1 − epoch 0's, "
        "paired within each cell, mean [the crossed model's 95% interval]: " + "; ".join(parts) + "."
    )
    return table + "\n\n" + line + bias_sentence(data)


def _b(x: float) -> str:
    return f"{x:.1f}".replace("-", "−")


def bias_sentence(data: dict) -> str:
    """The sigmoid arms' bias (the siglip arm set): its calibrated start b₀ and how far training moved it."""
    rows = [r for r in data["final"] if r.get("logit_bias_init") not in (None, "", "nan")]
    if not rows:
        return ""
    parts = []
    for arm in [a for a in data["run"]["arms"] if any(r["arm"] == a for r in rows)]:
        b0 = [float(r["logit_bias_init"]) for r in rows if r["arm"] == arm]
        moved = [float(r["logit_bias"]) - float(r["logit_bias_init"]) for r in rows if r["arm"] == arm]
        parts.append(
            f"{arm} b₀ {_b(sum(b0) / len(b0))} (cells {_b(min(b0))} to {_b(max(b0))}), moved by "
            f"{sum(moved) / len(moved):+.4f} on average (|change| ≤ {max(map(abs, moved)):.4f})"
        )
    return (
        "\n\nThe sigmoid arms' learnable bias, over the cells: its calibrated start b₀ (the zero of the arm's own "
        "dL/db on the cell's first-epoch batches at the initialisation) and its change by the last step: "
        + "; ".join(parts)
        + "."
    )


def regime_table(data: dict) -> str:
    """Per arm and epoch, over all cells: batches with InfoNCE < 1e-3 / rows whose float32 positive gradient rounds to 0."""
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
        f"Batches with InfoNCE < 1e-3 / directional rows whose float32 positive-logit gradient "
        f"(softmax(logits)[i, i] − 1) rounds to 0, mean over the {len(start)} (initialisation, seed) cells. At the "
        f"start of fine-tuning {sat0:.0%} of the batches are below 1e-3 (target ≥ 50%, paper 80%): the target is "
        + ("reached" if sat0 >= 0.5 else "not reached")
        + f"; ClipLoss's best epoch has {best:.0%}. Rows whose float32 positive-logit gradient rounds to 0, at the "
        f"start: {zero0:.0%}. That is not a row whose whole gradient is 0 (its negatives' gradients, softmax(logits)[i, j], "
        "stay non-zero unless they underflow too), and not the paper's zero-gradient figure."
    )
    return sentence + "\n\n" + md_table(header, body)


def _leakage_sentence(leak: dict) -> str:
    if "held_out_in_training" not in leak:  # version 4: the guard compared caption strings
        return (
            f"Leakage check (version 4, caption strings only): {leak['held_out_scenes']} held-out items "
            f"({leak['held_out_captions']} distinct captions) against {leak['training_captions']} distinct training "
            f"captions: {leak['shared_captions']} captions shared. It does not compare canonical scenes."
        )
    return (
        f"Leakage check (asserted by the run; canonical scenes read from the captions, a caption and its mirror one "
        f"scene): {leak['held_out_items']} held-out items ({leak['held_out_scenes']} distinct scenes; stage 1's "
        f"held-out set and every seed's pool) against {leak['training_scenes']} training scenes (stage 1 of every "
        f"initialisation and every cell's pool): {leak['held_out_in_stage1']} held-out items share a scene with "
        f"stage-1 data, {leak['held_out_in_training']} with any training set, {leak['held_out_captions_in_training']} "
        f"a caption string; {leak['held_out_pools_sharing_scenes']} scenes in two held-out pools."
    )


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
        _leakage_sentence(leak),
        "",
        f"Run: stage-1 width {cfg['width']}, {cfg['s1_train']} scenes; pool {run['pool_pairs']} pairs, "
        f"{cfg['epochs']} epochs, lr {cfg['lr']}; {cfg['threads']} torch thread; {run['cpu_seconds'] / 60:.1f} "
        f"CPU-minutes (user+sys) and {run['wall_seconds'] / 60:.1f} minutes wall, stage 1 included where trained "
        f"(load average {run['load_average_at_start']} at the start); {run['cpu']}, torch {run['torch']}."
        + (
            " Every initialisation was reused from stage 1's cache (trained beforehand by the same script and "
            "configuration): the run's CPU and wall time are stage 2's."
            if run["stage1"] and all(r.get("reused") for r in run["stage1"])
            else ""
        ),
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
    rows, which = data_comparisons(data), arm_set(data)
    p = rows[0]
    t = p["x"]
    out = [
        f"- Primary ({p['arm']} γ = 0.5 − {p['ref']}, t→i R@1): Δ = {_num(t['mean'])} "
        f"[{_num(t['low'])}, {_num(t['high'])}] over {t['n']} cells ({t['df']:.1f} df), Holm p {_p_is(p['holm_p'])}: "
        + (
            f"{p['arm']} is {_relation(p)} {p['ref']}."
            if _detected(p)
            else f"no difference detected; the smallest difference this run could detect is ±{p['mdd']:.3f}."
        )
    ]
    found = [r for r in rows[1:] if _detected(r)]
    for r in found:
        out.append(
            f"- {r['arm']} is {_relation(r)} {r['ref']} on {LABEL[r['metric']]}: Δ = {_num(r['x']['mean'])} "
            f"[{_num(r['x']['low'])}, {_num(r['x']['high'])}] ({r['x']['df']:.1f} df), Holm p {_p_is(r['holm_p'])}."
        )
    none = [r for r in rows[1:] if not _detected(r)]
    if none:
        parts = [f"{pair_name(r, which)} on {LABEL[r['metric']]} (MDD {r['mdd']:.3f})" for r in none]
        out.append("- No difference detected (Holm p ≥ 0.05) for: " + "; ".join(parts) + ".")
    return "\n".join(out)


def readme_table(data: dict, rep: dict = None) -> str:
    """The README's short version: every arm on the primary metric (and, given ``rep``, the
    replication's verdict), then what the other metrics show."""
    every, which = data_comparisons(data), arm_set(data)
    rows = [r for r in every if r["metric"] == PRIMARY[1]]
    again = {(r["arm"], r["metric"]): r for r in comparisons(rep["final"], rep["run"]["arms"])} if rep else {}
    body = [
        [
            pair_name(r, which) + (" (primary)" if is_primary(r, which) else ""),
            f"{_num(r['x']['mean'])} [{_num(r['x']['low'])}, {_num(r['x']['high'])}]",
            f"{r['sign']['wins']}/{r['sign']['losses']}/{r['sign']['ties']}",
            _p(r["holm_p"]),
            verdict(r),
        ]
        + (
            [f"{_num(again[(r['arm'], r['metric'])]['x']['mean'])}: {verdict(again[(r['arm'], r['metric'])])}"]
            if rep
            else []
        )
        for r in rows
    ]
    head = (
        f"Δ t→i R@1 {'against ClipLoss' if which == 'main' else '(arm − reference)'} at the last epoch, "
        f"{design(data)[2]} "
        f"(mean [95% interval of the crossed initialisation × seed random-effects model], wins/losses/ties, "
        f"Holm p over all {len(every)} comparisons):"
    )
    others = [r for r in every if r["metric"] != PRIMARY[1] and _detected(r)]
    tail = f"In {label(data)}, on the other metrics (i→t R@1, group accuracy both ways), " + (
        "differences are detected for: "
        + "; ".join(
            f"{pair_name(r, which)} {verdict(r)} on {LABEL[r['metric']]} ({_num(r['x']['mean'])})" for r in others
        )
        + "; none for the rest."
        if others
        else "no difference is detected."
    )
    header = ["arm vs ClipLoss" if which == "main" else "comparison", "Δ", "W/L/T", "Holm p", "verdict"] + (
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
        t = r["x"]
        return f"{_num(t['mean'])} [{_num(t['low'])}, {_num(t['high'])}], Holm p {_p(r['holm_p'])}: {verdict(r)}"

    body = []
    for r in rows:
        q = again[(r["arm"], r["metric"])]
        same = _detected(r) == _detected(q) and (not _detected(r) or (r["x"]["mean"] > 0) == (q["x"]["mean"] > 0))
        body.append([r["arm"], LABEL[r["metric"]], cell(r), cell(q), "yes" if same else "no"])
    found = [r for r in first if _detected(r)]
    held = [
        r
        for r in found
        if _detected(again[(r["arm"], r["metric"])])
        and (r["x"]["mean"] > 0) == (again[(r["arm"], r["metric"])]["x"]["mean"] > 0)
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


def same_cells(data: dict, other: dict) -> str:
    """How many of a run's initialisation and ClipLoss rows (final.csv and regime.csv) repeat those
    of ``other`` bit for bit, over the cells both ran: the shared arm's cells re-run."""
    found = []
    for name in ("final", "regime"):
        theirs = {tuple(sorted(r.items())) for r in other[name] if r["arm"] in (INIT_ARM, BASE)}
        ours = [
            tuple(sorted((k, v) for k, v in r.items() if k not in ("logit_bias_init", "logit_bias")))
            for r in data[name]
            if r["arm"] in (INIT_ARM, BASE)
        ]
        found.append(f"{sum(r in theirs for r in ours)} of {len(ours)} {name}.csv rows")
    return (
        f"The initialisation and ClipLoss rows repeat {label(other)}'s bit for bit (the same cells and "
        f"thread count): {' and '.join(found)} identical."
    )


SIGLIP_TABLES = {  # the committed SigLIP run's regions (docs/studies.md)
    "study-siglip-results": TABLES["study-results"],
    "study-siglip-levels": levels_table,
    "study-siglip-regime": regime_table,
    "study-siglip-run": lambda d: run_table(d) + "\n\n" + same_cells(d, load(COMMITTED)),
}
TABLES.update(SIGLIP_TABLES)
SOURCES = dict.fromkeys(SIGLIP_TABLES, SIGLIP)  # a table's committed run (the others: COMMITTED)


def render_all(folder: str) -> str:
    """Every table of one run (the replication table compares the two committed runs: not here)."""
    data = load(folder)
    return "\n\n".join(f"## {name}\n\n{make(data)}" for name, make in ONE_RUN.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", default=None, help="a run's output (default: the committed runs)")
    ap.add_argument("--emit", choices=sorted(TABLES), help="print one table")
    a = ap.parse_args(argv)
    if a.emit:
        print(TABLES[a.emit](load(a.folder or SOURCES.get(a.emit, COMMITTED))))
    elif a.folder is None or a.folder == COMMITTED:  # the committed runs: every region of the docs
        data = {where: load(where) for where in (COMMITTED, SIGLIP)}
        print("\n\n".join(f"## {name}\n\n{make(data[SOURCES.get(name, COMMITTED)])}" for name, make in TABLES.items()))
    else:
        print(render_all(a.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
