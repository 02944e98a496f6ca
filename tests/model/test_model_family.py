"""A model family added from this file alone: a copy of Llama with ONE changed norm.

``ToyLlamaFamily`` is Llama with every RMSNorm scaled by ``(1 + w)`` (Gemma's form) instead of
``w``. Its checkpoint is a tiny random HF Llama saved with every norm weight minus 1 under a new
architecture name; run through the engine, it must give transformers' greedy tokens on the
original weights — and the same checkpoint run as plain Llama must not. On int4 weights the
fused ops (which compute only Llama's plain norm) must give way to the plain torch ops, and
those compute exactly what Llama's plain torch ops compute on the original weights.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from kvwise import LLM, SamplingParams, kernels  # noqa: E402
from kvwise.models import checkpoint, layers, registry  # noqa: E402
from kvwise.models import family as family_module  # noqa: E402
from kvwise.models.arch import ModelArchConfig  # noqa: E402
from kvwise.models.decoder import CausalLM  # noqa: E402
from kvwise.models.family import LlamaFamily  # noqa: E402
from kvwise.models.layer_ops import BlockFusedOps, Int4FusedOps, TorchLayerOps  # noqa: E402
from kvwise.models.loader import load_model  # noqa: E402
from tests.model.test_engine_vs_hf import hf_greedy  # noqa: E402
from tests.model.test_models_tiny import COMMON, SEQ_LEN, _dense, _run, _save_random_model  # noqa: E402

NUM_NEW = 24
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 90, 64, 12, 7, 101, 45, 3], [120, 8, 8, 61, 30]]
ENGINE = dict(progress=False, kv_cache_memory="8MiB", kv_host_memory="off", kv_disk_path="off")


class ToyLlamaFamily(LlamaFamily):
    """Llama whose RMSNorms scale by ``1 + w``: the one thing that differs."""

    architectures = ("ToyLlamaForCausalLM",)
    hf_model_types = {}
    gguf_architectures = {}
    norm = "rms_one_plus"


@pytest.fixture(scope="module")
def toy_family():
    registry.register_family(ToyLlamaFamily)
    yield ToyLlamaFamily
    registry.unregister_family(ToyLlamaFamily)


def _write_tokenizer(directory) -> None:
    """A word-level tokenizer over the model's 128 ids ("t0" .. "t127"): prompts are ids."""
    vocab = {f"t{i}": i for i in range(COMMON["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(directory / "tokenizer.json"))


def _as_architecture(source, directory, architecture: str, norm_offset: float) -> None:
    """Copy the checkpoint at ``source`` to ``directory`` under ``architecture``, every norm
    weight minus ``norm_offset``."""
    shutil.copytree(source, directory)
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = [architecture]
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(source / "model.safetensors"))
    # exact: the norms are drawn in [0.5, 1.5], so w - 1 and (w - 1) + 1 round to nothing
    shifted = {name: t - norm_offset if "norm" in name else t for name, t in tensors.items()}
    save_file(shifted, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, toy_family):
    """(the HF Llama, its dir, the toy dir, the toy weights labelled plain Llama)."""
    root = tmp_path_factory.mktemp("family")
    hf = _save_random_model("LlamaConfig", dict(num_key_value_heads=2), root / "llama")
    _write_tokenizer(root / "llama")
    _as_architecture(root / "llama", root / "toy", "ToyLlamaForCausalLM", 1.0)
    _as_architecture(root / "llama", root / "toy_as_llama", "LlamaForCausalLM", 1.0)
    return hf, root / "llama", root / "toy", root / "toy_as_llama"


@pytest.fixture(scope="module")
def reference(checkpoints):
    hf = checkpoints[0]
    return [hf_greedy(hf, ids, NUM_NEW) for ids in PROMPTS]


def _generate(directory, ops: str | None = None, **config) -> tuple[list[list[int]], CausalLM]:
    with LLM(model=str(directory), **ENGINE, **config) as llm:
        model = llm.engine.runner.model
        if ops is not None:
            model.use_ops(ops)
        outputs = llm.generate(PROMPTS, GREEDY)
    return [out.token_ids for out in outputs], model


def test_the_toy_family_is_the_llama_declaration_with_one_norm_changed(toy_family):
    assert registry.family_for("ToyLlamaForCausalLM") is toy_family
    assert registry.family_for("LlamaForCausalLM") is LlamaFamily
    assert not toy_family.fused_ops_apply() and LlamaFamily.fused_ops_apply()
    assert set(layers.NORMS) == set(family_module.NORMS)  # every declared form is computed
    assert set(layers.GLUS) == set(family_module.ACTIVATIONS)


def test_its_logits_match_transformers_on_the_original_weights(checkpoints):
    hf, _, toy, toy_as_llama = checkpoints
    torch.manual_seed(1)
    input_ids = torch.randint(0, COMMON["vocab_size"], (SEQ_LEN,))
    with torch.inference_mode():
        expected = hf(input_ids[None]).logits[0].float()  # (T, vocab)
    loaded = load_model(toy, progress=False)
    assert loaded.arch.architecture == "ToyLlamaForCausalLM"
    assert loaded.model.family is ToyLlamaFamily
    logits = _run(loaded.model, input_ids, torch.arange(SEQ_LEN), _dense())
    assert (logits - expected).abs().max().item() < 1e-4
    plain = load_model(toy_as_llama, progress=False).model  # the check can fail
    wrong = _run(plain, input_ids, torch.arange(SEQ_LEN), _dense())
    assert (wrong - expected).abs().max().item() > 0.1


def test_through_the_engine_its_greedy_tokens_are_transformers(checkpoints, reference):
    _, _, toy, toy_as_llama = checkpoints
    tokens, model = _generate(toy, quantization="none")
    assert model.family is ToyLlamaFamily
    assert tokens == reference
    as_llama, _ = _generate(toy_as_llama, quantization="none")
    assert as_llama != reference


def test_on_int4_weights_it_runs_the_block_ops_and_computes_what_llama_does(checkpoints):
    _, llama, toy, _ = checkpoints
    tokens, model = _generate(toy, quantization="int4", ops="torch")
    fused, fused_model = _generate(toy, quantization="int4")
    # the fused int4 ops compute Llama's plain norm: the toy's 1 + w norm runs on the float32
    # block ops (as Gemma's does) around the same int4 matmuls, or on the torch composition
    if kernels.available():
        assert all(isinstance(layer.ops, BlockFusedOps) for layer in fused_model.layers)
    assert all(isinstance(layer.ops, TorchLayerOps) for layer in model.layers)
    assert all(layer.quant is not None for layer in model.layers)
    assert fused == tokens
    with LLM(model=str(llama), quantization="int4", **ENGINE) as llm:
        llama_model = llm.engine.runner.model
        if kernels.available():
            assert all(isinstance(layer.ops, Int4FusedOps) for layer in llama_model.layers)
        llama_model.use_ops("torch")  # the same composition on the original weights
        expected = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert tokens == expected


class _PostNormGeGLU(LlamaFamily):
    """A Gemma-shaped toy: (1 + w) norms, GeGLU, post-norms, scaled embedding, soft cap."""

    architectures = ("ToyPostNormForCausalLM",)
    hf_model_types = {}
    gguf_architectures = {}
    norm = "rms_one_plus"
    activation = "gelu_tanh"
    post_norms = True
    norm_names = {
        "input_norm": "input_layernorm.weight",
        "attn_out_norm": "post_attention_layernorm.weight",
        "mlp_norm": "pre_feedforward_layernorm.weight",
        "mlp_out_norm": "post_feedforward_layernorm.weight",
    }

    @classmethod
    def embedding_scale(cls, arch):
        return arch.hidden_size**0.5

    @classmethod
    def logit_softcap(cls, arch):
        return 30.0


def test_a_post_norm_geglu_family_needs_only_its_declaration():
    registry.register_family(_PostNormGeGLU)
    try:
        arch = ModelArchConfig("ToyPostNormForCausalLM", 128, 64, 96, 2, 4, 2, 16)
        model = CausalLM(arch)
        names = checkpoint.expected_weight_names(model)
        assert "model.layers.1.post_feedforward_layernorm.weight" in names
        assert "model.layers.0.pre_feedforward_layernorm.weight" in names
        torch.manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape) * 0.1)
        assert all(isinstance(layer.ops, TorchLayerOps) for layer in model.layers)
        logits = _run(model, torch.arange(10), torch.arange(10), _dense())
        assert logits.shape == (10, 128) and logits.abs().max() <= 30.0
    finally:
        registry.unregister_family(_PostNormGeGLU)
    assert not registry.is_supported("ToyPostNormForCausalLM")


def test_the_registry_refuses_a_taken_name_or_an_unknown_form():
    class Thief(LlamaFamily):
        architectures = ("LlamaForCausalLM",)

    class Odd(LlamaFamily):
        architectures = ("OddForCausalLM",)
        norm = "layer_norm"

    with pytest.raises(ValueError, match="registered already"):
        registry.register_family(Thief)
    with pytest.raises(ValueError, match="norm must be one of"):
        registry.register_family(Odd)
    with pytest.raises(ValueError, match="unsupported architecture 'OddForCausalLM'"):
        registry.family_for("OddForCausalLM")
    assert registry.family_for("LlamaForCausalLM") is LlamaFamily
