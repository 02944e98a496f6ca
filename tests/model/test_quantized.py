"""The quantized path: int4 / int8 models match a dequantize-then-matmul reference on random
tiny models of every supported architecture, the default model's Q4_1 weights run natively,
and greedy outputs on quantized weights are the same whether the prefix was computed cold,
hit in the device pool or loaded from the disk tier."""

from __future__ import annotations

import pytest
import torch

from kvwise import kernels
from kvwise.models.layer_ops import LINEAR_NAMES, Int4FusedOps, Int8FusedOps, TorchLayerOps
from kvwise.models.loader import load_model
from tests.model.test_models_tiny import CASES, SEQ_LEN, _dense, _run, _save_random_model
from tests.tiers_util import evict_device, run

pytestmark = pytest.mark.slow

# quantized logits vs the same weights dequantized and run in float32: what the kernels'
# activations allow, as a fraction of the largest logit. bfloat16 into int8 weights: up to
# 1.5% seen; int8 per block of 32 into int4 weights: 1.6-3.1% seen on these random models
# (their activations have no structure to spare; the default model's accuracy is measured by
# `kvwise eval`).
TOLERANCE = {"int8": 0.03, "int4": 0.05}


def _dequantized_reference(directory, quantized):
    """The float model with every quantized weight replaced by its dequantized value."""
    reference = load_model(directory, progress=False, quantization="none").model
    with torch.no_grad():
        for layer, qlayer in zip(reference.layers, quantized.layers):
            for name in LINEAR_NAMES:
                getattr(layer, name).copy_(qlayer.quant[name].dequantize().t())
        reference.embed.copy_(quantized.embed_quant.dequantize())
        reference.lm_head.copy_(quantized.lm_head_quant.dequantize().t())
    return reference


# the ops each weight format runs when asked for (the int4 and int8 fused ops differ)
OPS_CLASSES = {
    ("int4", "fused"): Int4FusedOps,
    ("int8", "fused"): Int8FusedOps,
    ("int4", "torch"): TorchLayerOps,
    ("int8", "torch"): TorchLayerOps,
}


@pytest.mark.parametrize("ops", ["fused", "torch"])
@pytest.mark.parametrize("weight_format", ["int4", "int8"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_quantized_tiny_models_match_a_dequantized_reference(tmp_path, name, weight_format, ops):
    config_name, overrides = CASES[name]
    _save_random_model(config_name, overrides, tmp_path)
    loaded = load_model(tmp_path, progress=False, quantization=weight_format)
    assert loaded.weight_format == weight_format
    model = loaded.model
    assert all(layer.quant is not None for layer in model.layers)
    if ops == "fused" and not kernels.available():
        pytest.skip("the kvwise kernels are unavailable here")
    # installed: the fastest ops there are, so the fused ones where the kernels are built
    assert all(layer.ops.name == ("fused" if kernels.available() else "torch")
               for layer in model.layers)  # fmt: skip
    model.use_ops(ops)  # "torch": the plain-torch quantized step (no compiler)
    assert all(type(layer.ops) is OPS_CLASSES[weight_format, ops] for layer in model.layers)
    reference = _dequantized_reference(tmp_path, model)
    torch.manual_seed(1)
    input_ids = torch.randint(0, 128, (SEQ_LEN,))
    attn = _dense(loaded.arch.sliding_window)
    got = _run(model, input_ids, torch.arange(SEQ_LEN), attn)
    want = _run(reference, input_ids, torch.arange(SEQ_LEN), attn)
    assert got.dtype == torch.float32
    diff = (got - want).abs().max().item()
    assert diff <= TOLERANCE[weight_format] * want.abs().max().item(), f"{name} {weight_format}"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    # and the weights shrank: int4 < int8 < float32
    assert model.weight_bytes() < reference.weight_bytes() / 2


@pytest.fixture(scope="module")
def quantized(smollm2_int4):
    return smollm2_int4


def test_the_default_gguf_runs_its_q4_1_weights_natively(quantized, smollm2):
    assert quantized.weight_format == "int4"
    assert quantized.model.weight_bytes() <= 120e6 < smollm2.model.weight_bytes()
    assert quantized.fingerprint != smollm2.fingerprint  # KV of one is never served to other
    layer = quantized.model.layers[0]
    assert layer.qkv_proj is None and layer.quant["qkv_proj"].group_size == 32
    if kernels.available():
        assert all(isinstance(layer.ops, Int4FusedOps) for layer in quantized.model.layers)


def test_greedy_tokens_are_the_same_cold_from_the_device_and_from_disk(
    make_engine, quantized, tmp_path
):
    engine = make_engine(loaded=quantized, kv_disk_path=str(tmp_path), kv_store_min_tokens=16)
    cold = run(engine)
    device = run(engine)
    assert device.num_cached_tokens > 0 and device.num_loaded_tokens == 0
    evict_device(engine)
    loaded = run(engine)
    assert loaded.num_loaded_tokens > 0
    assert cold.token_ids == device.token_ids == loaded.token_ids
    engine.close()


def test_a_layer_refuses_ops_it_does_not_know_or_cannot_run(quantized, smollm2):
    layer = quantized.model.layers[0]
    before = layer.ops
    with pytest.raises(ValueError, match="ops: expected"):
        layer.use_ops("bogus")
    with pytest.raises(ValueError, match="ops: expected"):
        quantized.model.use_ops("int4")  # the old step names are gone
    assert layer.ops is before  # unchanged
    float_layer = smollm2.model.layers[0]  # float weights: no fused ops
    with pytest.raises(ValueError, match="ops: 'fused' cannot run"):
        float_layer.use_ops("fused")
    assert isinstance(float_layer.ops, TorchLayerOps)
