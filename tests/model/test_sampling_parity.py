"""Logprobs, prompt logprobs, penalties and logit bias on the real default model (float32 path).

Logprobs: each chosen token's equals the log-softmax of the engine's own logits at that step
within 1e-4 (the logits recomputed by a cold prefill of prompt + outputs, a path with other
rounding), the top k sorted, the chosen one among them when greedy; prompt logprobs equal
transformers' log-softmax over the same prompt within 1e-4, alone and batched, with a cached
prefix (a request asking for them computes every row) and in prefill chunks. Penalties and
bias: a +100 bias forces its token; a -100 one bans the greedy choice; a repetition penalty
of 10 never repeats a token of the prompt or output where the unpenalized run does; frequency
and presence penalties change the tokens; bad values are a ValueError naming the field.
"""

from __future__ import annotations

import pytest
import torch

from kvwise.errors import InvalidRequest
from kvwise.types import SamplingParams
from tests.model.test_engine_vs_hf import run_outputs

PROMPTS = [
    "The following is a list of prime numbers: 2, 3, 5, 7,",
    "Once upon a time, in a small village by the mountains,",
    "def fibonacci(n):\n    ",
]


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=kwargs.pop("max_tokens", 12), temperature=0,
                          ignore_eos=True, **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(prefill_chunk_size=None)


def _cold_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """The engine's log-softmax at every position of ``ids``, by one cold prefill asking for
    prompt logprobs of the top 20 (the row of position p predicts token p + 1)."""
    out = run_outputs(engine, [ids], _greedy(max_tokens=1, prompt_logprobs=20))[0]
    return out.prompt_logprobs


def test_chosen_logprobs_are_the_log_softmax_and_tops_are_sorted(engine):
    outs = run_outputs(engine, PROMPTS, _greedy(logprobs=5))
    for out in outs:
        assert len(out.top_logprobs) == len(out.token_ids) == len(out.logprobs)
        ids = out.prompt_token_ids + out.token_ids
        again = _cold_logprobs(engine, ids)
        for i, (token, logprob, top) in enumerate(zip(out.token_ids, out.logprobs,
                                                      out.top_logprobs)):  # fmt: skip
            pos = len(out.prompt_token_ids) + i
            assert abs(again[pos][0] - logprob) < 1e-4, (i, again[pos][0], logprob)
            assert [t for t, _ in top][0] == token  # greedy: the chosen one is the best
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True) and len(top) == 5
            assert abs(top[0][1] - logprob) < 1e-6
    zero = run_outputs(engine, PROMPTS[:1], _greedy(logprobs=0))[0]
    assert zero.top_logprobs == [[]] * len(zero.token_ids)
    assert run_outputs(engine, PROMPTS[:1], _greedy())[0].top_logprobs is None


def test_prompt_logprobs_are_transformers(engine, make_engine, hf_smollm2):
    ids = [engine.tokenize(p) for p in PROMPTS]
    with torch.inference_mode():
        want = [torch.log_softmax(hf_smollm2(torch.tensor([i])).logits[0].float(), -1)
                for i in ids]  # fmt: skip
    run_outputs(engine, [ids[0]], _greedy())  # its blocks cached: the next request computes
    chunked = make_engine(prefill_chunk_size=8, max_num_batched_tokens=16)
    for eng in (engine, chunked):
        outs = run_outputs(eng, ids, _greedy(max_tokens=2, prompt_logprobs=3))
        for prompt, out, ref in zip(ids, outs, want):
            got = out.prompt_logprobs
            assert len(got) == len(prompt) and got[0] is None
            for p in range(1, len(prompt)):
                logprob, top = got[p]
                assert abs(logprob - float(ref[p - 1, prompt[p]])) < 1e-4, p
                assert [t for t, _ in top] == ref[p - 1].topk(3).indices.tolist()
            assert out.num_cached_tokens == 0


def test_logit_bias_forces_and_bans(engine):
    plain = run_outputs(engine, PROMPTS[:1], _greedy(max_tokens=4))[0].token_ids
    forced = run_outputs(engine, PROMPTS[:1], _greedy(max_tokens=4, logit_bias={42: 100.0}))[0]
    assert forced.token_ids == [42] * 4
    banned = run_outputs(engine, PROMPTS[:1], _greedy(max_tokens=1,
                                                      logit_bias={plain[0]: -100.0}))[0]  # fmt: skip
    assert banned.token_ids[0] != plain[0]
    with pytest.raises(InvalidRequest, match="logit_bias"):
        engine.add_request("x", _greedy(logit_bias={10**7: 1.0}))


def test_penalties_change_the_tokens(engine):
    prompt = "one two one two one two one two one two"
    params = dict(max_tokens=24)
    plain = run_outputs(engine, [prompt], _greedy(**params))[0]
    seen = set(plain.prompt_token_ids)
    assert any(t in seen for t in plain.token_ids)  # the check can fail
    rep = run_outputs(engine, [prompt], _greedy(repetition_penalty=10.0, **params))[0]
    tokens = rep.token_ids
    assert not any(t in seen for t in tokens) and len(set(tokens)) == len(tokens)
    for name in ("frequency_penalty", "presence_penalty"):
        out = run_outputs(engine, [prompt], _greedy(**{name: 2.0}, **params))[0]
        assert out.token_ids != plain.token_ids, name
        assert len(set(out.token_ids)) > len(set(plain.token_ids)), name


@pytest.mark.parametrize(
    "field,value",
    [("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 99), ("presence_penalty", 3.0),
     ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("logit_bias", {1: 200.0}),
     ("logit_bias", {-1: 1.0}), ("logit_bias", [(1, 2, 3)])],
)  # fmt: skip
def test_bad_values_name_their_field(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**{field: value})
