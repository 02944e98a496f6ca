"""Gemma 2 and Gemma 3 against transformers.

Tiny random ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` (built by transformers, saved as HF
directories) with a window of 8 tokens on their local layers (prompt and output reach ~5x it)
and a softmax scale of query_pre_attn_scalar 24 (not head_dim 16), the Gemma 2s with their
attention scores soft-capped (attn_logit_softcapping 50.0, the released models', and 2.0, where
the cap bends most scores): kvwise's logits within 1e-4 of transformers' (float32; dense
attention with each layer's declared window, scale and soft cap) and, through the engine (whose
attention applies each layer's window, scale and soft cap: the paged kernel, and the torch
path), transformers' greedy tokens, alone and batched. Run without the windows, with the
default scale, with one rotary base or without the attention soft cap, the same weights are not
transformers'. The tiny models are untied (a random tied model repeats one token); a tied one
is checked on its logits, and the real model is tied.

The real Gemma 3 270M Q4_K_M GGUF: ``quantization="none"`` gives transformers' greedy tokens on
the same file (8 prompts under the window of 512 x 32 tokens, alone and batched; one prompt of
~1,600 tokens, in one prefill and in chunks); ``"auto"`` runs every tensor at its own type and
agrees with "none" on the next token. Config parsing (transformers 4.x's layout, GGUF
metadata) is checked without weights; refused values name their field.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from kvwise import LLM, SamplingParams, kernels  # noqa: E402
from kvwise.config import EngineConfig  # noqa: E402
from kvwise.engine.builder import build_engine  # noqa: E402
from kvwise.models import checkpoint, registry  # noqa: E402
from kvwise.models.arch import RopeScaling  # noqa: E402
from kvwise.models.arch_load import arch_from_gguf, arch_from_hf_config  # noqa: E402
from kvwise.models.decoder import CausalLM  # noqa: E402
from kvwise.models.layer_ops import TorchLayerOps  # noqa: E402
from kvwise.models.layers import dense_causal_attention  # noqa: E402
from kvwise.models.loader import load_model  # noqa: E402
from kvwise.worker.attention import LayerAttention  # noqa: E402
from kvwise.worker.attention_backend import make_attention  # noqa: E402
from tests.model.test_engine_vs_hf import hf_greedy, run  # noqa: E402
from tests.model.test_model_family import _write_tokenizer  # noqa: E402

TINY = dict(
    vocab_size=128,  # _write_tokenizer's word-level vocabulary
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,  # softmax scale 24 ** -0.5, not head_dim ** -0.5
    sliding_window=8,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
CASES = {
    # final soft cap 5: far from linear on these logits (|logit| up to ~3); the attention
    # scores capped at 50 (the released models' cap)
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=4, attn_logit_softcapping=50.0,
                                    final_logit_softcapping=5.0)),
    # the attention scores capped at 2: most of them bent (the engine without the cap: other
    # tokens, test_without_the_attention_soft_cap_the_tokens_are_not_transformers)
    "gemma2_cap2": ("Gemma2Config", dict(num_hidden_layers=4, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=5.0)),
    # five local layers (base 10,000), one global (1,000,000, linear scaling on it alone)
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6,
                                        rope_scaling=dict(rope_type="linear", factor=4.0))),
}  # fmt: skip
NUM_NEW = 24
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
PROMPTS = [
    [2, 5, 17, 33, 2, 90, 64, 12, 7, 101, 45, 3],
    [2, 120, 8, 8, 61, 30],
    [2, 77],
    [2, 9, 9, 9, 9, 9, 9, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53],
]
ENGINE = dict(progress=False, kv_cache_memory="8MiB", kv_host_memory="off", kv_disk_path="off")
ENGINE_KV = dict(kv_cache_memory="8MiB", kv_host_memory="off", kv_disk_path="off")


def _save_random_gemma(config_name: str, overrides: dict, directory, **changes):
    """A random transformers Gemma saved at ``directory`` (with a word-level tokenizer)."""
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**TINY, **overrides, **changes})
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)  # scales 1 + w in [0.5, 1.5]
            elif "embed" in name:
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, 0.1)
    hf.save_pretrained(directory)
    _write_tokenizer(directory)
    return hf


def _kind_attention(model):
    """Dense attention over one sequence with each layer's declared window, scale and soft
    cap."""
    kinds = model.attention_kinds

    def attn(layer_idx, q, k, v):
        kind = kinds[layer_idx]
        return dense_causal_attention(
            q, k, v, kind.softmax_scale, kind.sliding_window, kind.softcap
        )

    return attn


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(input_ids, torch.arange(len(input_ids)), _kind_attention(model))
        return model.compute_logits(hidden)  # (T, vocab)


def _hf_logits(hf, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf(input_ids[None]).logits[0].float()  # (T, vocab)


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    """(case name, the transformers model, its directory, its greedy tokens on PROMPTS)."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = _save_random_gemma(*CASES[request.param], directory)
    reference = [hf_greedy(hf, ids, NUM_NEW) for ids in PROMPTS]
    assert len({t for tokens in reference for t in tokens}) >= 16  # not one-token loops
    return request.param, hf, directory, reference


def test_tiny_logits_match_transformers(tiny):
    name, hf, directory, _ = tiny
    loaded = load_model(directory, progress=False)
    assert loaded.arch.architecture == hf.config.architectures[0]
    assert all(isinstance(layer.ops, TorchLayerOps) for layer in loaded.model.layers)
    torch.manual_seed(1)
    input_ids = torch.randint(0, TINY["vocab_size"], (40,))
    diff = (_logits(loaded.model, input_ids) - _hf_logits(hf, input_ids)).abs().max().item()
    assert diff < 1e-4, f"{name}: max abs diff {diff}"


def test_tiny_greedy_tokens_are_transformers_alone_and_batched(tiny):
    _, _, directory, reference = tiny
    with LLM(model=str(directory), quantization="none", **ENGINE) as llm:
        batched = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
        alone = [llm.generate([ids], GREEDY)[0].token_ids for ids in PROMPTS]
    assert batched == reference
    assert alone == reference


def test_without_the_attention_soft_cap_the_tokens_are_not_transformers(tmp_path):
    """The cap-2 Gemma 2 through the engine: transformers' tokens through the paged kernel
    and through the torch path (explicit scores); other tokens with the cap taken off its
    layers; int4 KV (its kernel caps too): alone as batched, and other tokens uncapped."""
    hf = _save_random_gemma(*CASES["gemma2_cap2"], tmp_path)
    reference = [hf_greedy(hf, ids, NUM_NEW) for ids in PROMPTS]
    loaded = load_model(tmp_path, progress=False)
    config = EngineConfig.from_kwargs(model=str(tmp_path), **ENGINE_KV)
    engine = build_engine(config, progress=False, loaded=loaded)
    assert engine.runner.attention.paged_kernel == kernels.available()
    assert run(engine, PROMPTS, GREEDY) == reference
    torch_path = build_engine(config, progress=False, loaded=loaded)
    attention = torch_path.runner.attention
    torch_path.runner.attention = make_attention(attention.kv_cache, attention.num_heads,
                                                     attention.head_dim, paged_kernel=False,
                                                     layers=attention.layers,
                                                     places=attention.places)  # fmt: skip
    assert run(torch_path, PROMPTS, GREEDY) == reference
    uncapped = build_engine(config, progress=False, loaded=loaded)
    attention = uncapped.runner.attention
    attention.layers = [LayerAttention(k.window, k.scale) for k in attention.layers]
    assert run(uncapped, PROMPTS, GREEDY) != reference
    int4 = EngineConfig.from_kwargs(model=str(tmp_path), **{**ENGINE_KV, "kv_cache_dtype": "int4"})
    capped = build_engine(int4, progress=False, loaded=loaded)
    assert capped.runner.attention.paged_kernel == kernels.available()
    tokens = run(capped, PROMPTS, GREEDY)
    assert [run(capped, [ids], GREEDY)[0] for ids in PROMPTS] == tokens
    uncapped = build_engine(int4, progress=False, loaded=loaded)
    attention = uncapped.runner.attention
    attention.layers = [LayerAttention(k.window, k.scale) for k in attention.layers]
    assert run(uncapped, PROMPTS, GREEDY) != tokens


def test_tiny_declarations(tiny):
    name, hf, directory, _ = tiny
    loaded = load_model(directory, progress=False)
    arch = loaded.arch
    kinds = CausalLM(arch).attention_kinds
    windows = [kind.sliding_window for kind in kinds]
    if name.startswith("gemma2"):  # every other layer local, from layer 0; one rotary; no q/k
        assert windows == [8, None, 8, None]  # norm; every layer's scores capped
        assert {(k.rope_theta, k.rope_scaling) for k in kinds} == {(10000.0, None)}
        assert not arch.qk_norm and arch.final_logit_softcap == 5.0
        cap = hf.config.attn_logit_softcapping
        assert arch.attn_logit_softcap == cap and {k.softcap for k in kinds} == {cap}
        config = EngineConfig.from_kwargs(model=str(directory), **ENGINE_KV)
        layers = build_engine(config, progress=False, loaded=loaded).runner.attention.layers
        assert [(k.window, k.softcap) for k in layers] == [(8, cap), (0, cap)] * 2
    else:  # five local (their own base, unscaled) to one global (scaled)
        assert windows == [8] * 5 + [None]
        assert [(k.rope_theta, k.rope_scaling) for k in kinds] == [(10000.0, None)] * 5 + [
            (1e6, RopeScaling("linear", factor=4.0))
        ]
        assert arch.qk_norm and arch.final_logit_softcap is None
        assert arch.attn_logit_softcap is None and {k.softcap for k in kinds} == {None}
    assert {k.softmax_scale for k in kinds} == {24**-0.5}
    assert arch.layer_types == tuple(hf.config.layer_types)


def test_tied_gemma2_matches_transformers(tmp_path):
    hf = _save_random_gemma(*CASES["gemma2"], tmp_path, tie_word_embeddings=True)
    loaded = load_model(tmp_path, progress=False)
    assert loaded.arch.tie_word_embeddings
    input_ids = torch.arange(2, 30)
    diff = (_logits(loaded.model, input_ids) - _hf_logits(hf, input_ids)).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize(
    "case, changes",
    [
        ("gemma3", dict(sliding_window=None, layer_types=())),  # every layer full
        ("gemma3", dict(query_pre_attn_scalar=None)),  # head_dim ** -0.5
        ("gemma3", dict(rope_theta=10000.0, rope_scaling=None)),  # the global layer's rotary
        ("gemma2_cap2", dict(attn_logit_softcap=None)),  # the attention scores uncapped
    ],
    ids=["no_window", "default_scale", "one_rotary", "no_attention_soft_cap"],
)
def test_the_checks_can_fail(tmp_path, case, changes):
    hf = _save_random_gemma(*CASES[case], tmp_path)
    arch = arch_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    model = CausalLM(arch.replace(**changes))
    checkpoint.load_weights(model, load_file(str(tmp_path / "model.safetensors")).items())
    input_ids = torch.arange(2, 40)
    assert (_logits(model, input_ids) - _hf_logits(hf, input_ids)).abs().max().item() > 1e-2


# llama.cpp's names for a Gemma layer's tensors (conversion/gemma.py, gguf's tensor map)
_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _write_gemma_gguf(hf, arch: str, path) -> None:
    """``hf`` as llama.cpp's converter writes a Gemma: F32 tensors, every norm weight plus 1,
    no query_pre_attn_scalar (llama.cpp assumes head_dim), the tied head left out."""
    gguf = pytest.importorskip("gguf")
    config = hf.config
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    else:  # the global layers' base and scaling; the local base is llama.cpp's 10,000
        full = config.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue
        w = tensor.detach().float().numpy() + (1.0 if name.endswith("norm.weight") else 0.0)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, layer, within = name.split(".", 3)
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[within]}"
        writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_a_tiny_gemma_gguf_is_its_checkpoint(tmp_path, name, quantization):
    """Written as llama.cpp writes it (norms + 1, its tensor names), read back under both
    loaders (F32 tensors: "auto" runs them as float32 too) it computes transformers' logits."""
    hf = _save_random_gemma(*CASES[name], tmp_path, query_pre_attn_scalar=16,
                            tie_word_embeddings=True)  # fmt: skip
    path = tmp_path / f"{name}.gguf"
    _write_gemma_gguf(hf, name.split("_")[0], path)
    loaded = load_model(path, progress=False, quantization=quantization)
    assert loaded.arch.layer_types == tuple(hf.config.layer_types)
    assert loaded.arch.attn_logit_softcap == hf.config.attn_logit_softcapping
    assert loaded.weight_format == quantization.replace("auto", "gguf")
    input_ids = torch.arange(2, 40)
    diff = (_logits(loaded.model, input_ids) - _hf_logits(hf, input_ids)).abs().max().item()
    assert diff < 1e-4, f"{name} {quantization}: max abs diff {diff}"


# ---- configs: transformers 4.x's layout, GGUF metadata, refused values -------------------------

# google/gemma-3-270m's config.json as transformers 4.x writes it (no layer_types here: the
# pattern stands in), with a scaled global rotary as Gemma 3 4B has
GEMMA3_4X = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144,
    hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
    rope_local_base_freq=10000.0, rope_scaling=dict(rope_type="linear", factor=8.0),
    query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
    final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
)  # fmt: skip
GEMMA2_HF = dict(
    architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000,
    hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_act="gelu_pytorch_tanh",
    hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
    final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
)  # fmt: skip


def test_a_transformers_4_gemma3_config():
    arch = arch_from_hf_config(GEMMA3_4X)
    kinds = registry.family_for(arch.architecture).attention_kinds(arch)
    assert [k.sliding_window for k in kinds] == ([512] * 5 + [None]) * 3
    scaled = RopeScaling("linear", factor=8.0)
    assert {(k.rope_theta, k.rope_scaling) for k in kinds[:5]} == {(10000.0, None)}
    assert kinds[5].rope_theta == 1e6 and kinds[5].rope_scaling == scaled
    assert arch.qk_norm and arch.tie_word_embeddings and arch.final_logit_softcap is None


class _Field:
    def __init__(self, value) -> None:
        self.value = value

    def contents(self):
        return self.value


def _gguf_reader(arch: str, layers: int, **metadata):
    """The metadata of a gemma2/gemma3 GGUF (no weights): what ``from_gguf`` reads."""
    fields = {"general.architecture": arch, "tokenizer.ggml.bos_token_id": 2,
              "tokenizer.ggml.eos_token_id": 1}  # fmt: skip
    common = {"embedding_length": 2304, "feed_forward_length": 9216, "block_count": layers,
              "attention.head_count": 8, "attention.head_count_kv": 4,
              "attention.key_length": 256, "attention.layer_norm_rms_epsilon": 1e-6,
              "context_length": 8192, "rope.freq_base": 10000.0}  # fmt: skip
    fields.update({f"{arch}.{key}": value for key, value in {**common, **metadata}.items()})
    return SimpleNamespace(
        fields={key: _Field(value) for key, value in fields.items()},
        tensors=[SimpleNamespace(name="token_embd.weight", shape=(2304, 256000))],
    )


def test_gguf_metadata_of_each_gemma():
    gemma2 = arch_from_gguf(_gguf_reader("gemma2", 26))
    assert gemma2.layer_types == ("sliding_attention", "full_attention") * 13
    assert (gemma2.sliding_window, gemma2.final_logit_softcap) == (4096, 30.0)  # llama.cpp's
    assert gemma2.attn_logit_softcap == 50.0  # llama.cpp's default too
    assert gemma2.query_pre_attn_scalar == 256 and gemma2.sliding_rope_theta is None
    flags = [True, False, True, True] * 6 + [True, False]  # one flag a layer
    gemma3 = arch_from_gguf(_gguf_reader(
        "gemma3", 26, **{"attention.sliding_window": 512,
                         "attention.sliding_window_pattern": flags}))  # fmt: skip
    assert [t == "sliding_attention" for t in gemma3.layer_types] == flags
    assert gemma3.sliding_rope_theta == 10000.0 and gemma3.final_logit_softcap is None
    assert gemma3.attn_logit_softcap is None
    # llama.cpp scales the 27B models by hidden / heads (query_pre_attn_scalar 144 / 168)
    big = arch_from_gguf(_gguf_reader("gemma3", 62, **{"attention.sliding_window": 1024}))
    assert big.query_pre_attn_scalar == 2304 // 8
    full = arch_from_gguf(_gguf_reader("gemma3", 26))  # no window: every layer full
    assert full.layer_types == () and full.sliding_window is None


@pytest.mark.parametrize(
    "config, field",
    [
        (dict(GEMMA3_4X, use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(GEMMA3_4X, layer_types=["chunked_attention"] * 18), "layer_types"),
        (dict(GEMMA3_4X, layer_types=["full_attention"] * 17), "layer_types"),
        (dict(GEMMA3_4X, rope_parameters=dict(
            sliding_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e4),
            full_attention=dict(rope_type="default", rope_theta=1e6))),
         "rope_parameters.sliding_attention"),
        (dict(GEMMA3_4X, hidden_activation="gelu"), "hidden_activation"),
        (dict(GEMMA3_4X, final_logit_softcapping=-1.0), "final_logit_softcap"),
        (dict(GEMMA2_HF, attn_logit_softcapping=0.0), "attn_logit_softcap"),
    ],
)  # fmt: skip
def test_unsupported_values_are_refused_by_name(config, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        arch_from_hf_config(config)


_NO_ATTN_CAP = {k: v for k, v in GEMMA2_HF.items() if k != "attn_logit_softcapping"}


@pytest.mark.parametrize(
    "config, cap",
    [
        (GEMMA2_HF, 50.0),
        (_NO_ATTN_CAP, 50.0),  # absent: transformers' default
        (dict(GEMMA2_HF, attn_logit_softcapping=None), None),
        (dict(GEMMA2_HF, attn_logit_softcapping=20), 20.0),
        (dict(GEMMA3_4X, attn_logit_softcapping=30.0), 30.0),  # Gemma 3 caps where told to
    ],
)
def test_a_config_json_soft_caps_every_layers_attention(config, cap):
    arch = arch_from_hf_config(config)
    kinds = registry.family_for(arch.architecture).attention_kinds(arch)
    assert arch.attn_logit_softcap == cap and {k.softcap for k in kinds} == {cap}


@pytest.mark.parametrize(
    "metadata, cap",
    [({"attn_logit_softcapping": 50.0}, 50.0), ({}, 50.0),  # absent: llama.cpp's default
     ({"attn_logit_softcapping": 10.0}, 10.0), ({"attn_logit_softcapping": 0.0}, None)],
)  # fmt: skip
def test_a_gemma2_gguf_soft_caps_every_layers_attention(metadata, cap):
    arch = arch_from_gguf(_gguf_reader("gemma2", 26, **metadata))
    kinds = registry.family_for(arch.architecture).attention_kinds(arch)
    assert arch.attn_logit_softcap == cap and {k.softcap for k in kinds} == {cap}
