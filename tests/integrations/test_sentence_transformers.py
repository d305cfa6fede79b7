"""hnclip_kernels.integrations.sentence_transformers against sentence-transformers' own
MultipleNegativesRankingLoss (γ = 0, loss and every parameter's gradient), a float64 oracle of
the margin's formula written here (γ > 0, every embedding row's gradient), the GradCache
variant, SentenceTransformerTrainer steps, the refused options and 2 gloo ranks.

The model: a 1-layer BERT of hidden size 16 built from a local config with a 21-word WordPiece
vocabulary, saved under a temporary directory and loaded as ``models.Transformer`` + mean
``Pooling`` (nothing downloaded; dropout 0, so the cached and uncached passes are the same function).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

pytest.importorskip("sentence_transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer.losses import (  # noqa: E402
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer  # noqa: E402
from sentence_transformers.util import dot_score  # noqa: E402

from helpers import spawn_gloo_ranks  # noqa: E402
from hnclip_kernels.backends import cpp_directional  # noqa: E402
from hnclip_kernels.integrations.sentence_transformers import (  # noqa: E402
    CachedHNMultipleNegativesRankingLoss,
    HNMultipleNegativesRankingLoss,
)

WORDS = "a the cat dog sat on mat ran park red blue car house tree bird sky big old new".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
N = 6
F64_BACKENDS = ["torch", "cpp"] if cpp_directional() is not None else ["torch"]
ONE = ("query_to_doc",)
BOTH = ("query_to_doc", "doc_to_query")
# (directions, partition_mode) that MNRL and this loss both compute: one direction under either partition
CONFIGS = [(ONE, "joint"), (ONE, "per_direction"), (BOTH, "per_direction")]
TOL = 1e-12  # float64 on both sides; relative to the largest |value| of the compared tensor
# the attention's key bias: softmax is invariant to a constant per query, so its exact gradient is 0
# and both sides hold rounding noise (~1e-20); it is checked against the whole gradient's largest entry
ZERO_GRAD = "attention.self.key.bias"


def save_tiny_bert(path, seed=0):
    from transformers import BertConfig, BertModel, BertTokenizer

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(path)
    BertTokenizer(vocab=vocab).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="module")
def model64(bert_dir):
    """The float64 model, shared: the tests here only read it (``loss_and_grads`` zeroes its gradients)."""
    return tiny_st(bert_dir)


def tiny_st(path, dtype=torch.float64):
    transformer = Transformer(path)
    model = SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")])
    return model.to(dtype)


def sentences(n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))) for _ in range(n)]


def features(model, n_columns, n=N, seed=0):
    """Tokenized columns (anchor, positive, negative_1, …) of n rows each."""
    return [dict(model.preprocess(sentences(n, seed + 100 * c))) for c in range(n_columns)]


def loss_and_grads(model, loss_fn, feats):
    model.zero_grad()
    loss = loss_fn([dict(f) for f in feats], None)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def max_rel_diff(got, want, scale=None):
    """max |got − want| / max |want| over a tensor (a gradient's entries share one scale), or / ``scale``."""
    scale = want.abs().max().clamp_min(1e-300) if scale is None else scale
    return ((got - want).abs().max() / scale).item()


def compare(got, want, tol=TOL):
    """Loss and every parameter's gradient: (loss abs diff, worst gradient relative diff)."""
    (loss_g, grads_g), (loss_w, grads_w) = got, want
    assert grads_g.keys() == grads_w.keys() and len(grads_w) > 10
    loss_diff = abs(loss_g.item() - loss_w.item())
    largest = max(g.abs().max().item() for g in grads_w.values())
    worst = max(max_rel_diff(grads_g[k], grads_w[k], largest if k.endswith(ZERO_GRAD) else None) for k in grads_w)
    assert loss_diff <= tol * abs(loss_w.item()), (loss_g.item(), loss_w.item())
    assert worst <= tol, worst
    return loss_diff, worst


@pytest.mark.parametrize("backend", F64_BACKENDS)
@pytest.mark.parametrize(
    "directions,partition_mode,n_negatives", [(ONE, "joint", 0), (ONE, "per_direction", 2), (BOTH, "per_direction", 0),
                                              (BOTH, "per_direction", 2)]
)  # fmt: skip
def test_gamma0_equals_mnrl_loss_and_every_parameter_gradient(
    model64, directions, partition_mode, n_negatives, backend
):
    model = model64
    feats = features(model, 2 + n_negatives)
    kw = dict(scale=17.0, directions=directions, partition_mode=partition_mode)
    want = loss_and_grads(model, MultipleNegativesRankingLoss(model, **kw), feats)
    got = loss_and_grads(model, HNMultipleNegativesRankingLoss(model, gamma=0.0, backend=backend, **kw), feats)
    loss_diff, grad_diff = compare(got, want)
    print(f"{directions} {partition_mode} M={n_negatives} {backend}: |Δloss| {loss_diff:.1e}, grads {grad_diff:.1e}")


def test_float32_auto_backend_equals_mnrl(bert_dir):
    """The default backend on float32 embeddings (the C++ kernel where built), both configurations."""
    model = tiny_st(bert_dir, torch.float32)
    feats = features(model, 3)
    for directions, partition_mode in (CONFIGS[0], CONFIGS[2]):
        kw = dict(directions=directions, partition_mode=partition_mode)
        want = loss_and_grads(model, MultipleNegativesRankingLoss(model, **kw), feats)
        got = loss_and_grads(model, HNMultipleNegativesRankingLoss(model, gamma=0.0, **kw), feats)
        compare(got, want, tol=2e-5)


def oracle(anchors, positives, negatives, scale, gamma, margin, symmetric):
    """The loss written out in float64 (module docstring of the integration): logits
    s·(cos(v_i, x) + γ·sg(h_i·x̂)·[x is not row i's positive]) over x ∈ [positives; negatives],
    h = t̂ (margin "text") or v̂ ("image_text"); i2t rows, and with ``symmetric`` ½(i2t + t2i)."""
    v, t = (torch.nn.functional.normalize(x.double(), dim=1) for x in (anchors, positives))
    keys = t if negatives is None else torch.cat([t, torch.nn.functional.normalize(negatives.double(), dim=1)])
    n = v.shape[0]
    off_positive = torch.ones(n, keys.shape[0], dtype=torch.float64)
    off_positive[range(n), range(n)] = 0.0
    h = t if margin == "text" else v
    z = scale * (v @ keys.T + gamma * (h @ keys.T).detach() * off_positive)
    i2t = torch.logsumexp(z, dim=1) - z.diagonal()
    if not symmetric:
        return i2t.mean()
    zt = z[:, :n].T  # t2i: caption k's row over the images, the same logits (the margin sg(h_i·t_k) is symmetric)
    t2i = torch.logsumexp(zt, dim=1) - zt.diagonal()
    return 0.5 * (i2t.mean() + t2i.mean())


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 9),
    d=st.integers(2, 12),
    n_neg_columns=st.integers(0, 2),
    scale=st.floats(1.0, 60.0),
    gamma=st.floats(0.05, 2.0),
    margin=st.sampled_from(["text", "image_text"]),
    symmetric=st.booleans(),
    backend=st.sampled_from(F64_BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_margin_matches_float64_oracle_every_row_gradient(n, d, n_neg_columns, scale, gamma, margin, symmetric,
                                                          backend, seed):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    columns = [
        torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2 + n_neg_columns)
    ]
    directions, partition = (BOTH, "per_direction") if symmetric else (ONE, "joint")
    loss_fn = HNMultipleNegativesRankingLoss(
        None, scale=scale, directions=directions, partition_mode=partition, gamma=gamma, margin=margin, backend=backend
    )
    got = loss_fn.compute_loss_from_embeddings(columns)
    got_grads = torch.autograd.grad(got, columns)
    negatives = torch.cat(columns[2:]) if n_neg_columns else None
    want = oracle(columns[0], columns[1], negatives, scale, gamma, margin, symmetric)
    want_grads = torch.autograd.grad(want, columns)
    assert abs(got.item() - want.item()) <= 1e-12 * max(1.0, abs(want.item()))
    # every row of every column, against the gradient's natural scale s/min‖x‖ (dL/dx = s·(…)/‖x‖ with
    # |…| ≤ 2): a column's own largest entry can cancel to 0 (N = 1: the loss is 0 for every input).
    # Seen over 300 draws: 1.7e-15 of it
    for gg, gw, x in zip(got_grads, want_grads, columns):
        row_err = (gg - gw).abs().amax(dim=1) / (scale / x.detach().norm(dim=1).min())
        assert (row_err <= 1e-13).all(), row_err


@pytest.mark.parametrize("symmetric", [False, True])
def test_float32_backends_match_float64_oracle(symmetric):
    """Every backend on float32 embeddings (Triton interpreted on CPU), γ = 0.5 with a negative column."""
    g = torch.Generator().manual_seed(7)
    columns = [torch.randn(5, 8, generator=g, requires_grad=True) for _ in range(3)]
    directions, partition = (BOTH, "per_direction") if symmetric else (ONE, "joint")
    want = oracle(columns[0], columns[1], columns[2], 20.0, 0.5, "text", symmetric)
    want_grads = torch.autograd.grad(want, columns)
    for backend in ["torch", "triton"] + F64_BACKENDS[1:]:
        loss_fn = HNMultipleNegativesRankingLoss(None, directions=directions, partition_mode=partition, backend=backend)
        got = loss_fn.compute_loss_from_embeddings(columns)
        got_grads = torch.autograd.grad(got, columns)
        assert got.dtype == torch.float32 and abs(got.item() - want.item()) <= 2e-6 * abs(want.item()), backend
        for gg, gw in zip(got_grads, want_grads):
            assert max_rel_diff(gg.double(), gw) <= 2e-5, backend


@pytest.mark.parametrize("backend", F64_BACKENDS[-1:])  # the C++ kernel where built
def test_image_text_margin_one_direction_is_mnrl_all_negatives_hardness(model64, backend):
    """MNRL's LLaVE-style hardness α·sg(cos(q, d)) on every negative is margin="image_text" with γ = α/s."""
    model = model64
    feats = features(model, 3, seed=3)
    alpha, scale = 9.0, 20.0
    mnrl = MultipleNegativesRankingLoss(model, scale=scale, hardness_mode="all_negatives", hardness_strength=alpha)
    ours = HNMultipleNegativesRankingLoss(model, scale=scale, gamma=alpha / scale, margin="image_text", backend=backend)
    compare(loss_and_grads(model, ours, feats), loss_and_grads(model, mnrl, feats))


@pytest.mark.parametrize("directions,partition_mode,gamma", [(ONE, "joint", 0.0), (BOTH, "per_direction", 0.5)])
def test_cached_equals_uncached(model64, directions, partition_mode, gamma):
    """5 rows in mini-batches of 2 (3 per column), a negative column; at γ = 0 also sentence-transformers'
    CachedMultipleNegativesRankingLoss."""
    model = model64
    feats = features(model, 3, n=5, seed=5)
    kw = dict(scale=25.0, directions=directions, partition_mode=partition_mode, gamma=gamma, backend="torch")
    want = loss_and_grads(model, HNMultipleNegativesRankingLoss(model, **kw), feats)
    cached = CachedHNMultipleNegativesRankingLoss(model, mini_batch_size=2, **kw)
    compare(loss_and_grads(model, cached, feats), want)
    if gamma == 0.0:
        st_kw = dict(scale=25.0, directions=directions, partition_mode=partition_mode, mini_batch_size=2)
        compare(loss_and_grads(model, CachedMultipleNegativesRankingLoss(model, **st_kw), feats), want)


def test_config_citation_and_attributes(model64):
    model = model64
    loss = HNMultipleNegativesRankingLoss(model, scale=30.0, directions=BOTH, partition_mode="per_direction")
    assert loss.get_config_dict() == {
        "scale": 30.0, "similarity_fct": "cos_sim", "gather_across_devices": False, "directions": BOTH,
        "partition_mode": "per_direction", "gamma": 0.5, "margin": "text", "backend": "auto",
    }  # fmt: skip
    assert "2608.18521" in loss.citation and "Which Negatives Matter" in loss.citation
    assert loss.temperature == pytest.approx(1 / 30)
    loss.gamma = 0.25
    loss.scale = 10.0
    assert loss.get_config_dict()["gamma"] == 0.25 and loss.temperature == pytest.approx(0.1)
    cached = CachedHNMultipleNegativesRankingLoss(model, mini_batch_size=4, margin="image_text")
    config = cached.get_config_dict()
    assert config["mini_batch_size"] == 4 and config["margin"] == "image_text"
    assert "2101.06983" in cached.citation and "2608.18521" in cached.citation
    cached.gamma = 0.1  # delegated to the wrapped loss, checked there
    assert cached.loss.gamma == 0.1 and cached.gamma == 0.1
    with pytest.raises(ValueError, match="gamma"):
        cached.gamma = -1.0
    with pytest.raises(ValueError, match="joint"):
        loss.partition_mode = "joint"  # with both directions
    assert loss.partition_mode == "per_direction"  # nothing changed on error


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(similarity_fct=dot_score), ValueError, "similarity_fct=dot_score.*cos_sim"),
        (dict(similarity_fct="cos"), TypeError, "similarity_fct must be callable"),
        (dict(directions=BOTH), ValueError, "partition_mode='joint'.*per_direction"),
        (dict(directions=BOTH, partition_mode="joint"), ValueError, "partition_mode='per_direction'"),
        (dict(directions=ONE + ("query_to_query",)), ValueError, "query_to_query.*not supported"),
        (dict(directions=BOTH + ("doc_to_doc",), partition_mode="per_direction"), ValueError, "doc_to_doc"),
        (dict(directions=("doc_to_query",)), ValueError, "'query_to_doc' direction is required"),
        (dict(directions=()), ValueError, "At least one direction"),
        (dict(directions=("query_to_docs",)), ValueError, "Invalid directions"),
        (dict(directions="query_to_doc"), TypeError, "tuple of direction names"),
        (dict(partition_mode="separate"), ValueError, "partition_mode must be"),
        (dict(scale=0.0), ValueError, "scale must be a positive"),
        (dict(scale=math.inf), ValueError, "scale must be a positive"),
        (dict(scale="20"), TypeError, "scale must be a real number"),
        (dict(gamma=-0.1), ValueError, "gamma"),
        (dict(margin="query"), ValueError, "margin must be one of"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(hardness_mode="all_negatives", hardness_strength=9.0), ValueError, "margin='image_text'.*gamma=α/scale"),
        (dict(hardness_mode="hard_negatives", hardness_strength=5.0), ValueError, "no equivalent"),
        (dict(gather_across_devices=1), TypeError, "gather_across_devices"),
    ],
)
def test_unsupported_options_are_refused_by_name(kwargs, error, match):
    for cls in (HNMultipleNegativesRankingLoss, CachedHNMultipleNegativesRankingLoss):
        with pytest.raises(error, match=match):
            cls(_NotStatic(), **kwargs)


class _NotStatic(torch.nn.Sequential):
    """A model the cached loss's StaticEmbedding check accepts (its first module is no StaticEmbedding)."""

    def __init__(self):
        super().__init__(torch.nn.Identity())


def test_one_column_is_refused(model64):
    model = model64
    with pytest.raises(ValueError, match="at least 2"):
        HNMultipleNegativesRankingLoss(model)(features(model, 1), None)
    with pytest.raises(ValueError, match="at least 2"):
        CachedHNMultipleNegativesRankingLoss(model)(features(model, 1), None)


@pytest.mark.slow
@pytest.mark.parametrize("cached", [False, True])
def test_trainer_steps_train_the_model(tmp_path, capsys, cached):
    pytest.importorskip("datasets")
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    model = tiny_st(save_tiny_bert(tmp_path / "bert"), torch.float32)
    rows = 48
    data = Dataset.from_dict(
        {"anchor": sentences(rows, 1), "positive": sentences(rows, 2), "negative": sentences(rows, 3)}
    )
    kw = dict(scale=20.0, directions=BOTH, partition_mode="per_direction", gamma=0.5)
    loss = CachedHNMultipleNegativesRankingLoss(model, mini_batch_size=4, **kw) if cached else (
        HNMultipleNegativesRankingLoss(model, **kw))  # fmt: skip
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_train_epochs=4, learning_rate=5e-3,
        logging_steps=6, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss)
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    with capsys.disabled():
        print(f"\n{type(loss).__name__} training log (every 6 of 24 steps): {[round(x, 4) for x in logged]}")
    assert len(logged) == 4 and all(math.isfinite(x) for x in logged)
    assert logged[-1] < logged[0]
    unchanged = [k for k, p in model.named_parameters() if torch.equal(p.detach(), before[k])]
    assert unchanged == ["0.model.pooler.dense.weight", "0.model.pooler.dense.bias"]  # mean pooling skips BERT's pooler


VARIANTS = {"ours0": (0.0, False), "mnrl": (0.0, True), "ours": (0.5, False)}  # name: (γ, MNRL itself)


def _gloo_rank(rank, world, bert_dir, directions, partition_mode):
    """This rank's half of the batch through the model, gather_across_devices=True, for each of
    VARIANTS: (loss, the model's gradients averaged over the ranks, as DDP averages them)."""
    model = tiny_st(bert_dir)
    feats = [{k: v[rank * N : (rank + 1) * N] if isinstance(v, torch.Tensor) else v for k, v in f.items()}
             for f in features(model, 3, n=world * N, seed=11)]  # fmt: skip
    kw = dict(scale=15.0, directions=directions, partition_mode=partition_mode, gather_across_devices=True)
    out = {}
    for name, (gamma, mnrl) in VARIANTS.items():
        loss_fn = MultipleNegativesRankingLoss(model, **kw) if mnrl else HNMultipleNegativesRankingLoss(
            model, gamma=gamma, backend="torch", **kw)  # fmt: skip
        loss, grads = loss_and_grads(model, loss_fn, feats)
        for g in grads.values():
            torch.distributed.all_reduce(g)
        out[name] = (loss.item(), {k: (g / world).numpy() for k, g in grads.items()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("directions,partition_mode", [CONFIGS[0], CONFIGS[2]])
def test_gather_across_devices_on_two_gloo_ranks(tmp_path, bert_dir, directions, partition_mode):
    """2 ranks × 6 rows with a negative column: at γ = 0 each rank's loss and the averaged
    gradients equal MNRL's with gather_across_devices; at γ = 0.5 the mean of the rank losses and
    the averaged gradients equal the single-process loss on the concatenated 12 rows."""
    runs = spawn_gloo_ranks(_gloo_rank, tmp_path, bert_dir, directions, partition_mode, timeout=180)
    as_torch = {
        (name, r): (torch.tensor(loss, dtype=torch.float64), {k: torch.from_numpy(g) for k, g in grads.items()})
        for r, out in runs.items()
        for name, (loss, grads) in out.items()
    }
    for r in (0, 1):
        loss_diff, grad_diff = compare(as_torch["ours0", r], as_torch["mnrl", r])
        print(f"rank {r} {directions} vs MNRL gather_across_devices: |Δloss| {loss_diff:.1e}, grads {grad_diff:.1e}")
    model = tiny_st(bert_dir)
    single = HNMultipleNegativesRankingLoss(
        model, scale=15.0, directions=directions, partition_mode=partition_mode, gamma=0.5, backend="torch"
    )
    want = loss_and_grads(model, single, features(model, 3, n=2 * N, seed=11))
    mean_loss = (as_torch["ours", 0][0] + as_torch["ours", 1][0]) / 2
    loss_diff, grad_diff = compare((mean_loss, as_torch["ours", 0][1]), want, tol=1e-11)
    print(f"γ = 0.5, 2 ranks vs one process on 12 rows: |Δloss| {loss_diff:.1e}, grads {grad_diff:.1e}")
    assert as_torch["ours", 0][0] != as_torch["ours", 1][0]  # each rank its own rows
