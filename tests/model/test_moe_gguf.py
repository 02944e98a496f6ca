"""Mixture-of-experts GGUF files written the way llama.cpp's converter writes them (qwen2moe,
qwen3moe, and Mixtral as "llama" with expert metadata: the experts stacked in ``ffn_{gate,up,down}_exps``, the router ``ffn_gate_inp``,
the shared expert ``*_shexp``): read as float experts and checked against transformers; and
with experts in mixed block types, run at the file's own types (``quantization="auto"``) and
checked against the file's float dequantization, batched and through every cache path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from kvwise import kernels  # noqa: E402
from kvwise.config import EngineConfig  # noqa: E402
from kvwise.engine.builder import build_engine  # noqa: E402
from kvwise.models.default import default_model_path  # noqa: E402
from kvwise.models.gguf_load import ConcatWeight  # noqa: E402
from kvwise.models.gguf_weights import open_gguf  # noqa: E402
from kvwise.models.layer_ops import GLUS  # noqa: E402
from kvwise.models.layers import dense_causal_attention  # noqa: E402
from kvwise.models.loader import load_model  # noqa: E402
from tests.model.test_gguf_native import (  # noqa: E402
    EXPERT_TYPES,
    EXPERTS,
    SHARED_TYPES,
    VOCAB,
    _logits,
    write_mixed_gguf,
)
from tests.model.test_gguf_tiny import (  # noqa: E402
    COMMON,
    _gguf_name,
    _llama_cpp_permute,
    _random_hf,
    add_common_metadata,
    finish,
)

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
CASES = {  # name: GGUF architecture, config, its settings
    "qwen3moe": ("qwen3moe", "Qwen3MoeConfig", dict(head_dim=16, norm_topk_prob=True, **MOE)),
    "qwen2moe": ("qwen2moe", "Qwen2MoeConfig", dict(shared_expert_intermediate_size=48, **MOE)),
    "mixtral": ("llama", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
}
_MOE_NAMES = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def _write_moe_gguf(hf, arch: str, path) -> None:
    config = hf.config
    writer = gguf.GGUFWriter(path, arch=arch)
    add_common_metadata(writer, config, arch)
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    inter = getattr(config, "moe_intermediate_size", config.intermediate_size)
    if arch != "llama":  # Mixtral's experts are feed_forward_length wide
        writer.add_expert_feed_forward_length(inter)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    for name, tensor in hf.state_dict().items():
        w = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:  # llama.cpp's rope row order
            w = _llama_cpp_permute(w, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _llama_cpp_permute(w, config.num_key_value_heads)
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        within = name.split(".", 3)[3] if layer is not None else None
        if within == "mlp.experts.gate_up_proj":  # (E, 2 * inter, hidden): gate rows first
            writer.add_tensor(
                f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(w[:, :inter])
            )
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(w[:, inter:]))
        elif within == "mlp.experts.down_proj":  # (E, hidden, inter)
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", w)
        elif within in _MOE_NAMES:
            if within == "mlp.shared_expert_gate.weight":
                w = w.reshape(-1)  # llama.cpp stores the shared gate as a vector
            writer.add_tensor(f"blk.{layer}.{_MOE_NAMES[within]}", w)
        else:
            writer.add_tensor(_gguf_name(name), w)
    finish(writer)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_moe_gguf_matches_transformers(case, tmp_path):
    arch, config_name, overrides = CASES[case]
    hf = _random_hf(config_name, **overrides)
    path = tmp_path / f"{case}.gguf"
    _write_moe_gguf(hf, arch, path)
    loaded = load_model(path, progress=False)
    assert loaded.arch.architecture == type(hf).__name__
    assert loaded.arch.num_experts == 4 and loaded.arch.num_experts_per_tok == 2
    assert loaded.arch.norm_topk_prob == (case != "qwen2moe")
    assert bool(loaded.arch.shared_expert_intermediate_size) == (case == "qwen2moe")
    torch.manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (20,))
    with torch.inference_mode():
        hidden = loaded.model(
            ids, torch.arange(20), lambda i, q, k, v: dense_causal_attention(q, k, v)
        )
        logits = loaded.model.compute_logits(hidden)
        expected = hf(ids[None]).logits[0]
    assert (logits - expected).abs().max().item() < 1e-4
    int8 = load_model(path, progress=False, quantization="int8")
    assert all(layer.moe.quant is not None for layer in int8.model.layers)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_experts_run_at_their_own_types(arch, tmp_path):
    """Every expert's weights are the file's own blocks (exactly its dequantization), the
    logits differ from the float path's by the activations' int8 rounding only, and a row's
    logits are the same bits alone and in a batch."""
    path = tmp_path / f"{arch}.gguf"
    write_mixed_gguf(path, arch)
    auto = load_model(path, progress=False, quantization="auto")
    exact = load_model(path, progress=False, quantization="none")
    report = {row.gguf_type: row for row in auto.weight_report}
    types = {t for layer in EXPERT_TYPES for t in layer.values()}
    if arch == "qwen2moe":
        types |= set(SHARED_TYPES.values())
    assert set(report) >= types and all(r.runs_as.endswith("(exact)") for r in report.values())
    assert auto.weight_format == "gguf"
    fused = kernels.available()  # the fused ops and the experts' stacks are the kernels'
    assert all(layer.ops.name == ("fused" if fused else "torch") for layer in auto.model.layers)
    for i, layer in enumerate(auto.model.layers):
        moe, floats = layer.moe, exact.model.layers[i].moe
        assert len(moe.quant) == EXPERTS + (arch == "qwen2moe")
        mixed = EXPERT_TYPES[i % 2]["ffn_gate_exps"] != EXPERT_TYPES[i % 2]["ffn_up_exps"]
        assert isinstance(moe.quant[0][0], ConcatWeight) == mixed
        for e in (0, EXPERTS - 1):
            assert torch.equal(moe.quant[e][0].dequantize(), floats.gate_up[e].t())
            assert torch.equal(moe.quant[e][1].dequantize(), floats.down[e].t())
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1))
    got, want = _logits(auto, ids), _logits(exact, ids)
    assert (got - want).norm() / want.norm() < 0.04
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
    if not fused:  # without the kernels, torch's matmuls: not batch-invariant (attention.py)
        return
    # a row's experts and sums do not depend on its neighbours
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(2))
    moe, glu = auto.model.layers[0].moe, GLUS[auto.model.family.activation]
    with torch.inference_mode():
        together = moe(x, glu)
        alone = torch.cat([moe(x[i : i + 1], glu) for i in range(6)])
    assert torch.equal(together, alone)
    # block-type experts run stacked (one kernel pass a projection), with the bits of running
    # them one by one; Q8_0 downs (layer 1) have no stack and run one by one
    assert moe.stacks is not None and auto.model.layers[1].moe.stacks is None
    # what a decode step reads of them: top_k / num_experts of the routed experts' bytes
    assert moe.routed_nbytes() == sum(p.nbytes for st in moe.stacks for _, p, _ in st.parts)
    stacks, moe.stacks = moe.stacks, None
    with torch.inference_mode():
        assert torch.equal(moe(x, glu), together)
    moe.stacks = stacks


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "qwen2moe.gguf"
    vocab = open_gguf(default_model_path()).fields["tokenizer.ggml.tokens"].contents()
    write_mixed_gguf(path, "qwen2moe", vocab=len(vocab), tokenizer_from=default_model_path())
    return path


def test_engine_greedy_identical_cold_cached_and_from_disk(moe_file, tmp_path):
    from tests.tiers_util import evict_device, run

    def engine(**kwargs):
        return build_engine(EngineConfig.from_kwargs(
            model=str(moe_file), quantization="auto", kv_cache_memory="64MiB",
            kv_host_memory="off", **kwargs), progress=False)  # fmt: skip

    tiered = engine(kv_disk_path=str(tmp_path), enable_prefix_caching=True)
    cold = run(tiered)
    cached = run(tiered)
    assert cached.num_cached_tokens > 0 and cached.token_ids == cold.token_ids
    evict_device(tiered)
    loaded = run(tiered)
    assert loaded.num_loaded_tokens > 0 and loaded.token_ids == cold.token_ids
    tiered.close()
    plain = engine(kv_disk_path="off", enable_prefix_caching=False)
    assert run(plain).token_ids == cold.token_ids
