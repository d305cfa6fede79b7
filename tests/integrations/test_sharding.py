"""``hnclip_kernels.sharding`` in one process: the (1,) ``logit_scale`` trains as the 0-dim one and
saves back 0-dim (the tiny models of ``test_chunked.py``). Under FSDP2 and DeepSpeed ZeRO-2/3 on 2
gloo ranks: ``test_chunked.py::test_two_gloo_ranks_ddp_and_fsdp2`` and ``test_deepspeed.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hnclip_kernels.sharding import squeeze_scalar_parameters, unsqueeze_scalar_parameters
from test_chunked import C, HFPairs, hf_batch, hf_model, hf_step, oc_batch, oc_model, oc_step


def _bits(t):
    return t.detach().reshape(()).numpy().tobytes()


def test_clip_model_trains_the_same_and_round_trips_save_pretrained(tmp_path):
    from transformers import CLIPModel

    scalar = hf_model(dropout=False)
    model = copy.deepcopy(scalar)
    assert unsqueeze_scalar_parameters(model) == ("logit_scale",)
    assert model.logit_scale.shape == (1,) and model.logit_scale.requires_grad
    assert _bits(model.logit_scale) == _bits(scalar.logit_scale)
    want_loss, want = hf_step(scalar, hf_batch(), C)
    loss, got = hf_step(model, hf_batch(), C)
    assert loss.item() == want_loss.item()
    for key in want:
        for name, grad in want[key].items():
            assert torch.equal(got[key][name].reshape(grad.shape), grad), name
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    model.save_pretrained(
        tmp_path / "squeezed", state_dict=squeeze_scalar_parameters(model.state_dict(), ("logit_scale",))
    )
    back = CLIPModel.from_pretrained(tmp_path / "squeezed")
    assert back.logit_scale.shape == () and _bits(back.logit_scale) == _bits(model.logit_scale)
    assert _bits(back.logit_scale) != _bits(scalar.logit_scale)  # the trained value
    model.save_pretrained(tmp_path / "as_is")  # what the helper prevents: a (1,) checkpoint CLIPModel refuses
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        CLIPModel.from_pretrained(tmp_path / "as_is")


def test_open_clip_state_dict_loads_into_the_unmodified_model():
    images, texts = oc_batch()
    model = oc_model(dropout=False)
    names = unsqueeze_scalar_parameters(model)
    assert names == ("logit_scale",) and not any(p.dim() == 0 for p in model.parameters())
    want_loss, _ = oc_step(oc_model(dropout=False), images, texts, C)
    loss, got = oc_step(model, images, texts, C)
    assert loss.item() == want_loss.item() and got["logit_scale"]["logit_scale"].shape == (1,)
    fresh = oc_model(dropout=False, seed=5)
    fresh.load_state_dict(squeeze_scalar_parameters(model.state_dict(), names))  # strict
    assert fresh.logit_scale.shape == () and _bits(fresh.logit_scale) == _bits(model.logit_scale)
    oc_model(dropout=False).load_state_dict(model.state_dict())  # torch reads (1,) into 0-dim (0.3 compatibility)
    with pytest.raises(RuntimeError, match="logit_scale"):  # not 0-dim into (1,): load first, then unsqueeze
        model.load_state_dict(oc_model(dropout=False).state_dict())


class _Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 2)
        self.temperature = nn.Parameter(torch.tensor(0.25), requires_grad=False)


def test_shared_frozen_and_already_1d_parameters():
    model = nn.Module()
    model.a = _Tower()
    model.b = model.a  # one module under two names: two state-dict keys, one parameter
    model.logit_scale = nn.Parameter(torch.tensor(2.5))
    model.logit_bias = nn.Parameter(torch.tensor([-1.0]))  # already (1,): left alone
    before = copy.deepcopy(model.state_dict())
    names = unsqueeze_scalar_parameters(model)
    assert names == ("logit_scale", "a.temperature", "b.temperature")
    assert model.a.temperature is model.b.temperature and not model.a.temperature.requires_grad
    assert model.a.temperature.shape == (1,) and model.logit_bias.shape == (1,)
    assert unsqueeze_scalar_parameters(model) == ()  # nothing 0-dim left
    restored = squeeze_scalar_parameters(model.state_dict(), names)
    assert list(restored) == list(before)
    assert all(restored[k].shape == v.shape and torch.equal(restored[k], v) for k, v in before.items())
    assert restored._metadata == model.state_dict()._metadata  # load_state_dict's versions
    assert squeeze_scalar_parameters(restored, "logit_scale")["logit_scale"].shape == ()  # idempotent, one name


def test_errors_name_the_argument_and_the_fix():
    model = oc_model(dropout=False)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        unsqueeze_scalar_parameters(model.state_dict())
    with pytest.raises(TypeError, match="bare model"):
        unsqueeze_scalar_parameters(nn.DataParallel(model))
    state = model.state_dict()
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        squeeze_scalar_parameters(list(state.items()), ["logit_scale"])
    with pytest.raises(ValueError, match="names: 'module.logit_scale' is not a key.*prefix"):
        squeeze_scalar_parameters(state, ["module.logit_scale"])
    with pytest.raises(ValueError, match=r"one value, got \(0,\).*GatheredParameters"):  # a ZeRO-3 placeholder
        squeeze_scalar_parameters({**state, "logit_scale": torch.empty(0)}, ["logit_scale"])


# ----------------------------------------------------------------------------- HNClipTrainer's checkpoints


def _trainer(model, tmp_path, **kw):
    from transformers import TrainingArguments

    from hnclip_kernels.integrations.transformers import HNClipTrainer

    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        per_device_train_batch_size=6,
        learning_rate=0.5,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    return HNClipTrainer(model=model, args=args, train_dataset=HFPairs(6), gamma=0.5, **kw)


def test_trainer_saves_a_0_dim_logit_scale_of_a_model_made_1d_beforehand(tmp_path):
    """docs/distributed.md's recipe (unsqueeze, then shard): the Trainer's checkpoint is the unmodified
    CLIPModel's, its trained logit_scale 0-dim, bit for bit."""
    from transformers import CLIPModel

    model = hf_model(dropout=False)
    unsqueeze_scalar_parameters(model)
    trainer = _trainer(model, tmp_path)
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    back = CLIPModel.from_pretrained(str(tmp_path / "out")).logit_scale
    assert back.shape == () and _bits(back) == _bits(model.logit_scale)
    assert _bits(back) != _bits(hf_model(dropout=False).logit_scale)  # the trained value
    assert model.logit_scale.shape == (1,)  # the model trains on as it was


def _sharded(monkeypatch, flag):
    """The Trainer's own view of an FSDP / DeepSpeed run (accelerate shards only on GPUs)."""
    from hnclip_kernels.integrations.transformers import HNClipTrainer

    original = HNClipTrainer.create_accelerator_and_postprocess

    def create(self):
        original(self)
        setattr(self, flag, True)

    monkeypatch.setattr(HNClipTrainer, "create_accelerator_and_postprocess", create)


@pytest.mark.parametrize("flag", ["is_fsdp_enabled", "is_deepspeed_enabled"])
def test_trainer_under_sharding_trains_logit_scale_1d_and_saves_it_0_dim(tmp_path, monkeypatch, flag):
    from transformers import CLIPModel

    _sharded(monkeypatch, flag)
    model = hf_model(dropout=False)
    value = _bits(model.logit_scale)
    trainer = _trainer(model, tmp_path)
    assert trainer.scalar_names == ("logit_scale",)
    assert model.logit_scale.shape == (1,) and _bits(model.logit_scale) == value  # before the Trainer wraps it
    trainer._save(str(tmp_path / "out"))  # what save_model calls with the gathered full state dict
    back = CLIPModel.from_pretrained(str(tmp_path / "out")).logit_scale
    assert back.shape == () and _bits(back) == value
    trainer._save(str(tmp_path / "ds"), state_dict={})  # DeepSpeed's fallback (own checkpoint): passed through
    if flag == "is_deepspeed_enabled":  # (under FSDP the Trainer itself refuses optimizers=)
        fresh = hf_model(dropout=False)  # an optimizer holding the 0-dim parameter would never train the new one
        with pytest.raises(ValueError, match="build the optimizer you pass after"):
            _trainer(fresh, tmp_path, optimizers=(torch.optim.SGD(fresh.parameters(), lr=0.1), None))
