"""Matmul work of one HN-CLIP forward+backward, counted in flops rather than timed.

    python -m tools.work [--n 256] [--m M] [--dims 512,768] [--dtypes bfloat16]
                              [--gammas 0,0.5] [--kinds loss,directional] [--csv PATH]

What runs: one forward+backward of ``hn_clip_loss(img, txt, tau, gamma=g, backend="triton")``
(kind "loss", N×N); of one direction of the distributed path,
``triton_directional()(q, k, query_txt=a, key_txt=b, tau=tau, offset=offset, gamma=g,
label_smoothing=0.0, normalize=True)`` with M local rows against N columns (kind "directional");
of a distributed rank's op, both directions of its M local rows against N gathered columns
in one call (``rank_nll_triton``, kind "rank", what ``HNClipLoss(local_loss=True)`` runs per
rank); and of the hard-negative family's loss, ``hn_clip_loss(img, txt, tau, negatives=neg,
gamma=g, backend="triton")`` with M negative captions (kind "family", ``hnclip::triton_symmetric_nll`` with negatives;
``--margins`` "text" or "image_text", ``--ids`` G: group ids ``arange(N) // G``, pairs of one
group masked); of the sigmoid (SigLIP) loss, ``sigmoid_pairs_triton(img, txt, s, b, gamma=g,
margin=..., negatives=neg)`` (kind "sigmoid", ``hnclip::triton_sigmoid_nll``, N rows against the
N + M keys, ``--m`` its negatives, default 0; ``--margins``, ``--ids`` as the family's, ids masking)
and of a rank's sigmoid rows (kind "sigmoid_rank": M local rows against N gathered captions at
offset N − M); of each row's own negatives, ``hn_clip_loss(img, txt, tau, negatives=(N, M, D))``
(kind "own", M = K own negatives a row, default 8, the host block's einsums inside the operator)
and of ``reduction="directions"`` (kind "directions", two directional ops; ``--m`` shared negatives,
default 0; kind "directions_own": with each row's K = M own negatives, default 8, i2t over the N
captions and the own columns' autograd einsums on the host, counted as torch matmuls); τ (s and b) a tensor that requires grad, as in training.

How: on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1), under the GPU launch
configuration: HNCLIP_TRITON_LAUNCH=gpu is set while a case runs, and the launcher then
uses the GPU tile sizes and warps even while interpreting. Two counters run together:

  * every ``tl.dot`` the kernels execute: the interpreter evaluates ``tl.dot`` through
    ``TritonSemantic.dot``, which ends in ``InterpreterBuilder.create_dot(a, b, acc, ...)``
    with the operands' numpy tiles; that method is wrapped for the duration of the count and
    adds 2·M·N·K (times any batch dimension) from the tile shapes. The interpreter runs full
    masked tiles, so the count includes tile padding: what the GPU executes.
    ``tl.dot_scaled`` is not counted and raises.
  * every matmul run by torch (mm, bmm, addmm, matmul, ...): torch.utils.flop_counter.FlopCounterMode,
    and ``torch.mm`` / ``torch.addmm`` / ``torch.bmm`` / ``torch.einsum`` (two operands: 2 · the
    product of every index's size) called where no dispatch mode is active:
    inside a custom operator's implementation (the interpreter's operators are opaque
    ``custom_op``s, run with the mode popped), e.g. the backward's GEMMs.

The same FlopCounterMode also counts the ``hnclip::`` operators by their registered formulas
(``hnclip_kernels/backends/triton/flops.py``): "formula_flops", what an MFU tool sees, kept
apart from the counted work: the formulas state the useful products of the real shapes (the
"useful" below, the same on the C++ operators), this tool what the kernels execute
(tests/tooling/test_work_count.py holds formula_flops equal to the useful products, and never
above the counted work).

Units: one product is an M×N×D matrix product, 2·M·N·D flops (M = N for the loss; N×N×D for
the family, whose M is its negatives). The useful work is 3 products per direction: S = q kᵀ in
the forward, dS·k and dSᵀ·q in the backward (6 for kind "rank", two directions); the loss's two
directions share S, so 3; the family's S = v [t; n]ᵀ is N×(N + M), so 3·(N + M)/N products of
N×N×D (M = 0: the loss's 3). "x_useful" is the total in products divided by that. The margin's
t tᵀ (t nᵀ), tile recomputation, padding and any torch matmul all count as overhead.
"""

from __future__ import annotations

import os

from .interpreted import LAUNCH_ENV, enter_interpreter, gpu_launch, write_rows  # before anything imports triton

enter_interpreter("tools.work", "counts tl.dot inside Triton's interpreter")

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from torch.utils._python_dispatch import _get_current_dispatch_mode  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from triton.runtime import interpreter as _interpreter  # noqa: E402

import hnclip_kernels  # noqa: E402
from hnclip_kernels.backends import triton_directional  # noqa: E402
from hnclip_kernels.backends.triton.ops import rank_nll_triton  # noqa: E402
from hnclip_kernels.backends.triton.sigmoid_pairs import sigmoid_pairs_triton  # noqa: E402
from hnclip_kernels.margin import Margin  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KINDS = ("loss", "directional", "rank", "family", "sigmoid", "sigmoid_rank", "own", "directions", "directions_own")
FAMILY_OPTIONS = ("family", "sigmoid", "own", "directions_own")  # the kinds that take ``margin`` and ``ids``
MARGINS = ("text", "image_text")
USEFUL_PRODUCTS = 3  # q kᵀ forward; dS·k and dSᵀ·q backward (per direction; a rank's op has two)
COLUMNS = [
    "kind",
    "n",
    "m",
    "d",
    "dtype",
    "gamma",
    "margin",
    "ids",
    "dot_flops",
    "torch_flops",
    "total_flops",
    "product_flops",
    "dot_products",
    "torch_products",
    "products",
    "useful_products",
    "x_useful",
    "dot_tiles",
    "formula_flops",
]


class MatmulCount:
    """Flops of the tl.dot calls the interpreter executed and of torch's matmuls."""

    def __init__(self):
        self.dot_flops = 0
        self.dot_tiles = collections.Counter()  # (M, N, K) of each tl.dot -> calls
        self.torch_flops = 0
        self.formula_flops = 0  # FlopCounterMode's count of the hnclip:: operators (their formulas)

    def _add_dot(self, a_shape, b_shape):
        *batch, m, k = a_shape
        n = b_shape[-1]
        reps = 1
        for x in batch:
            reps *= int(x)
        self.dot_flops += 2 * reps * int(m) * int(n) * int(k)
        self.dot_tiles[(int(m), int(n), int(k))] += reps


def _require_interpreter() -> None:
    if not triton.knobs.runtime.interpret:
        raise RuntimeError(
            "tools.work needs TRITON_INTERPRET=1 (it counts tl.dot in Triton's interpreter); "
            f"got TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}"
        )


@contextlib.contextmanager
def count_matmul_flops():
    """Count, inside the block, 2·M·N·K for every tl.dot run by Triton's interpreter and the
    flops of every torch matmul. Yields a :class:`MatmulCount`, complete when the block exits."""
    _require_interpreter()
    count = MatmulCount()
    builder = _interpreter.InterpreterBuilder
    # triton < 3.7's interpreter has no create_dot_scaled (nothing to refuse there)
    orig_dot, orig_scaled = builder.create_dot, getattr(builder, "create_dot_scaled", None)

    def create_dot(self, a, b, *args, **kwargs):
        count._add_dot(a.data.shape, b.data.shape)
        return orig_dot(self, a, b, *args, **kwargs)

    def create_dot_scaled(self, *args, **kwargs):
        raise NotImplementedError("tools.work does not count tl.dot_scaled")

    builder.create_dot, builder.create_dot_scaled = create_dot, create_dot_scaled
    torch_counter = FlopCounterMode(display=False)
    hidden = [0]  # flops of torch matmuls the mode cannot see (inside an opaque custom op)
    originals = {name: getattr(torch, name) for name in _TORCH_MATMULS}
    for name, fn in originals.items():
        setattr(torch, name, _counting(fn, _TORCH_MATMULS[name], hidden))
    try:
        with torch_counter:
            yield count
    finally:
        builder.create_dot, builder.create_dot_scaled = orig_dot, orig_scaled
        for name, fn in originals.items():
            setattr(torch, name, fn)
        by_op = torch_counter.get_flop_counts().get("Global", {})
        ours = sum(int(v) for op, v in by_op.items() if _is_ours(op))
        count.formula_flops = ours
        count.torch_flops = int(torch_counter.get_total_flops()) - ours + hidden[0]


def _is_ours(op) -> bool:
    """Is ``op`` (an OpOverloadPacket) one of the package's ``hnclip::`` operators?"""
    return str(op).startswith("hnclip.")


def _mm_flops(a, b, *_):
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _addmm_flops(c, a, b, *_):
    return _mm_flops(a, b)


def _bmm_flops(a, b, *_):
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


# torch functions counted by name when no dispatch mode sees them: a custom operator (the
# interpreter's ``hnclip::triton_*``) runs its implementation with FlopCounterMode popped off the
# mode stack, so the mode counts the opaque op, not the cuBLAS GEMMs of the backward inside it
def _einsum_flops(equation, *operands):
    """2 · Π every index's size: a two-operand contraction's multiply-adds (the own block's
    "nkd,nd->nk" and "nk,nkd->nd", N·K·D each)."""
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if len(inputs) != 2:
        raise NotImplementedError(f"tools.work counts two-operand einsums only, got {equation!r}")
    sizes = {c: int(n) for spec, x in zip(inputs, operands) for c, n in zip(spec, x.shape)}
    total = 2
    for n in sizes.values():
        total *= n
    return total


_TORCH_MATMULS = {"mm": _mm_flops, "addmm": _addmm_flops, "bmm": _bmm_flops, "einsum": _einsum_flops}


def _counting(fn, flops, hidden):
    def wrapper(*args, **kwargs):
        if _get_current_dispatch_mode() is None:  # FlopCounterMode (when active) counts the rest
            hidden[0] += int(flops(*args))
        return fn(*args, **kwargs)

    return wrapper


def count_products(
    n: int = 256,
    d: int = 512,
    dtype: str = "bfloat16",
    gamma: float = 0.5,
    kind: str = "loss",
    m: int | None = None,
    seed: int = 0,
    false_negative_threshold: float | None = None,
    margin: str = "text",
    ids: int | None = None,
) -> dict:
    """Matmul work of one forward+backward of one case, as a dict (keys: :data:`COLUMNS`).

    kind "loss": hn_clip_loss on (n, d) img/txt (m is n). kind "directional": m query rows
    (default n // 4, the last of 4 ranks) against n keys, positives at offset n - m, the margin's
    factors a, b the local and all text rows. kind "rank": the same rank's two directions in one
    op (local images and texts, m rows, against all n). One product is 2·m·n·d flops.
    kind "family": hn_clip_loss on (n, d) img/txt with m negative captions (default n; m = 0
    with neither ids nor ``margin="image_text"`` is today's loss), ``margin`` "text" or
    "image_text", ``ids`` a group size G (group ids ``arange(n) // G``; None: no ids); one
    product is 2·n·n·d flops, the useful work 3·(n + m)/n of them. kind "sigmoid": the sigmoid
    loss's n rows against n captions and m negatives (default 0), ``margin`` and ``ids`` as the
    family's (ids masking), counted as the family's; kind "sigmoid_rank": m rows (default n // 4)
    against n captions at offset n - m, counted as the directional op's.
    ``false_negative_threshold``: masking on (the kernels then form the captions' product G
    at γ = 0 too).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if margin not in MARGINS:
        raise ValueError(f"margin must be one of {MARGINS}, got {margin!r}")
    if kind not in FAMILY_OPTIONS and (margin != "text" or ids is not None):
        raise ValueError(f"margin={margin!r} and ids={ids!r} are kinds {FAMILY_OPTIONS}' options; got kind {kind!r}")
    if ids is not None and ids < 1:
        raise ValueError(f"ids is a group size G >= 1 (group ids arange(n) // G), got {ids!r}")
    if kind in (*FAMILY_OPTIONS, "directions"):
        m = {"family": n, "own": 8, "directions_own": 8}.get(kind, 0) if m is None else m
        if m < 0:
            raise ValueError(f"m={m} negatives: pass m >= 0")
    else:
        m = n if kind == "loss" else (m or max(1, n // 4))  # directional, rank, sigmoid_rank
        if m > n:
            raise ValueError(f"m={m} local rows cannot exceed n={n} columns")
    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    tau = torch.tensor(0.07, requires_grad=True)
    if kind in ("loss", "family", "sigmoid", "own", "directions", "directions_own"):
        img = torch.randn(n, d, generator=gen).to(dt).requires_grad_()
        txt = torch.randn(n, d, generator=gen).to(dt).requires_grad_()
        if kind in (*FAMILY_OPTIONS, "directions"):
            shape = (n, m, d) if kind in ("own", "directions_own") else (m, d)
            neg = torch.randn(*shape, generator=gen).to(dt).requires_grad_()
            group_ids = None if ids is None else torch.arange(n) // ids
    elif kind == "sigmoid_rank":
        offset = n - m
        img = torch.randn(m, d, generator=gen).to(dt).requires_grad_()
        txt = torch.randn(n, d, generator=gen).to(dt).requires_grad_()
    elif kind == "directional":
        offset = n - m  # the last rank's rows
        q = torch.randn(m, d, generator=gen).to(dt).requires_grad_()
        k = torch.randn(n, d, generator=gen).to(dt).requires_grad_()
        a, b = k.detach()[offset : offset + m].clone(), k.detach().clone()
        fn = triton_directional()
    else:
        offset = n - m
        all_img, all_txt = (torch.randn(n, d, generator=gen).to(dt).requires_grad_() for _ in range(2))
        img, txt = (x.detach()[offset : offset + m].clone().requires_grad_() for x in (all_img, all_txt))
    sb = (torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True))  # s and b
    with gpu_launch(), count_matmul_flops() as count:
        if kind == "sigmoid":
            kw = dict(negatives=neg if m else None, query_groups=group_ids, key_groups=group_ids)
            loss = sigmoid_pairs_triton(img, txt, *sb, gamma=gamma, margin=Margin(margin), **kw).sum()
        elif kind == "sigmoid_rank":
            loss = sigmoid_pairs_triton(img, txt, *sb, offset=offset, gamma=gamma).sum()
        elif kind in ("directions", "directions_own"):
            own = dict(margin=margin, group_ids=group_ids) if kind == "directions_own" else {}
            rows = hnclip_kernels.hn_clip_loss(img, txt, tau, gamma=gamma, backend="triton", reduction="directions",
                                               negatives=neg if m else None, **own,
                                               false_negative_threshold=false_negative_threshold)  # fmt: skip
            loss = sum(x.sum() for x in rows)
        elif kind in ("loss", "family", "own"):
            family = dict(negatives=neg, group_ids=group_ids, margin=margin) if kind != "loss" else {}
            loss = hnclip_kernels.hn_clip_loss(
                img,
                txt,
                tau,
                gamma=gamma,
                backend="triton",
                false_negative_threshold=false_negative_threshold,
                **family,
            )
        elif kind == "directional":
            loss = fn(
                q,
                k,
                query_txt=a,
                key_txt=b,
                tau=tau,
                offset=offset,
                gamma=gamma,
                label_smoothing=0.0,
                normalize=True,
                false_negative_threshold=false_negative_threshold,
            ).sum()
        else:
            loss = rank_nll_triton(
                img,
                txt,
                all_img,
                all_txt,
                tau=tau,
                offset=offset,
                gamma=gamma,
                label_smoothing=0.0,
                normalize=True,
                false_negative_threshold=false_negative_threshold,
            ).sum()
        loss.backward()
    if count.dot_flops == 0:
        raise RuntimeError(
            "no tl.dot ran in Triton's interpreter: are the kernels interpreted (TRITON_INTERPRET=1 "
            "before triton was first imported)?"
        )
    if kind in ("directions", "directions_own"):  # i2t's N×(N + M) (own: N + K) and t2i's N×N, no tile shared
        unit, useful = 2 * n * n * d, USEFUL_PRODUCTS * (2 * n + m) / n
    elif kind in FAMILY_OPTIONS:  # N×N×D products; the useful S = v [t; n]ᵀ is N×(N + M) (own: N + K)
        unit, useful = 2 * n * n * d, USEFUL_PRODUCTS * (n + m) / n
    else:
        unit, useful = 2 * m * n * d, USEFUL_PRODUCTS * (2 if kind == "rank" else 1)
    total = count.dot_flops + count.torch_flops
    return dict(
        kind=kind,
        n=n,
        m=m,
        d=d,
        dtype=dtype,
        gamma=float(gamma),
        margin=margin,
        ids=ids,
        dot_flops=count.dot_flops,
        torch_flops=count.torch_flops,
        total_flops=total,
        product_flops=unit,
        dot_products=count.dot_flops / unit,
        torch_products=count.torch_flops / unit,
        products=total / unit,
        useful_products=useful,
        x_useful=total / unit / useful,
        dot_tiles=" ".join(f"{a}x{b}x{c}:{k}" for (a, b, c), k in sorted(count.dot_tiles.items())),
        formula_flops=count.formula_flops,
    )


def _csv_list(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m tools.work", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=256, help="columns N (and rows, for the loss)")
    ap.add_argument(
        "--m",
        type=int,
        default=None,
        help="directional, rank, sigmoid_rank: local rows M (default N // 4); family: negatives M (default N); "
        "sigmoid, directions: negatives M (default 0); own, directions_own: K own negatives a row (default 8)",
    )
    ap.add_argument("--dims", type=_csv_list(int), default=[512, 768], help="embedding dims D")
    ap.add_argument("--dtypes", type=_csv_list(str), default=["bfloat16"], help=",".join(DTYPES))
    ap.add_argument("--gammas", type=_csv_list(float), default=[0.0, 0.5], help="margin scales γ")
    ap.add_argument("--kinds", type=_csv_list(str), default=list(KINDS), help=",".join(KINDS))
    ap.add_argument("--margins", type=_csv_list(str), default=["text"], help="family: " + ",".join(MARGINS))
    ap.add_argument("--ids", type=int, default=None, help="family: group ids arange(N) // IDS (default: no ids)")
    ap.add_argument("--csv", help="also write the rows to this CSV file")
    args = ap.parse_args(argv)
    for name, values, allowed in (
        ("--dtypes", args.dtypes, DTYPES),
        ("--kinds", args.kinds, KINDS),
        ("--margins", args.margins, MARGINS),
    ):
        bad = [v for v in values if v not in allowed]
        if bad:
            ap.error(f"{name}: unknown {bad}; choose from {','.join(allowed)}")
    return args


def _label(row) -> str:
    """The kind, with the family's options where they are not the defaults."""
    label = row["kind"]
    if row["margin"] != "text":
        label += f" {row['margin']}"
    if row["ids"] is not None:
        label += f" ids//{row['ids']}"
    return label


def format_table(rows) -> str:
    head = (
        f"{'kind':<22}{'N':>6}{'M':>6}{'D':>6}  {'dtype':<9}{'γ':>5}{'tl.dot':>9}{'torch':>8}"
        f"{'total':>8}{'x_useful':>10}  tl.dot tiles (MxNxK:calls)"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{_label(r):<22}{r['n']:>6}{r['m']:>6}{r['d']:>6}  {r['dtype']:<9}{r['gamma']:>5g}"
            f"{r['dot_products']:>9.2f}{r['torch_products']:>8.2f}{r['products']:>8.2f}"
            f"{r['x_useful']:>9.2f}x  {r['dot_tiles']}"
        )
    return "\n".join(lines)


def main(argv=None) -> list:
    args = parse_args(argv)
    if args.ids is not None and args.ids < 1:
        raise SystemExit(f"--ids is a group size G >= 1 (group ids arange(N) // G), got {args.ids}")
    rows = [
        count_products(
            args.n, d, dtype, gamma, kind, args.m, margin=margin, ids=args.ids if kind in FAMILY_OPTIONS else None
        )
        for kind in args.kinds
        for margin in (args.margins if kind in FAMILY_OPTIONS else ["text"])
        for dtype in args.dtypes
        for d in args.dims
        for gamma in args.gammas
    ]
    print(
        "matmul work of one forward+backward, in M×N×D products (2·M·N·D flops; useful work = 3 a direction; "
        "family: N×N×D products, useful 3·(N + M)/N); "
        f"Triton interpreter under {LAUNCH_ENV}=gpu"
    )
    print(format_table(rows))
    if args.csv:
        write_rows(rows, args.csv, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
