"""A whole engine on the fake runner and a byte tokenizer (no torch, milliseconds): scheduling
under preemption, loads from the tiers and their rollback, parking a session, request options
through every entry point. The real-weights tests (tests/model) keep the numerics."""

import pytest

from kvwise.engine.llm import LLM
from kvwise.errors import ContextLengthExceeded, QueueFullError, SessionBusy, SessionNotFound
from kvwise.store import serde
from kvwise.types import FinishReason, RequestOptions, SamplingParams
from tests.fakes import fake_engine, run_all
from tests.tiers_util import evict_device

P = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [f"prompt number {i}: " + "abcdefgh" * (2 + i % 3) for i in range(6)]
LONG = "The same long prefix every time, " * 3  # 99 bytes: 24 full blocks of 4


def run(engine, prompts, params=P, options=None) -> list:
    return run_all(engine, prompts, params, options)


def test_preemption_keeps_every_answer():
    roomy = run(fake_engine(num_blocks=512), PROMPTS)
    tight_engine = fake_engine(num_blocks=24, max_num_batched_tokens=64)
    tight = run(tight_engine, PROMPTS)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert all(len(o.token_ids) == 12 for o in tight)
    stats = tight_engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv.blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    tight_engine.check_integrity()


def test_a_different_block_table_would_change_the_answer():
    # the fake runner reads its context through the block tables: a prefix hit that mapped
    # the wrong blocks would show up as different tokens
    engine = fake_engine()
    first = run(engine, [LONG])[0]
    again = run(engine, [LONG])[0]
    assert again.num_cached_tokens == (len(LONG) - 1) // 4 * 4
    assert again.token_ids == first.token_ids
    assert run(fake_engine(), [LONG + "!"])[0].token_ids != first.token_ids


@pytest.mark.parametrize("layer_groups", [1, 2])
def test_load_from_host_tier_gives_the_same_tokens(layer_groups):
    reference = run(fake_engine(), [LONG])[0]
    engine = fake_engine(
        kv_host_memory="1MiB",
        kv_store_min_tokens=8,
        kv_chunk_blocks=2,
        kv_load_policy="always",
        kv_layer_groups=layer_groups,
    )
    run(engine, [LONG])
    evict_device(engine)
    out = run(engine, [LONG])[0]
    assert out.token_ids == reference.token_ids
    assert (
        out.num_loaded_tokens == (len(LONG) - 1) // 4 * 4
    )  # every full block but the last token's
    stats = engine.stats()
    assert stats.store.load_decisions == 1 and stats.store.tiers["host"].hits > 0
    assert stats.num_load_rollbacks == 0


def test_corrupt_entries_roll_back_and_are_written_again(tmp_path):
    reference = run(fake_engine(), [LONG])[0]
    engine = fake_engine(
        kv_disk_path=str(tmp_path),
        kv_store_min_tokens=8,
        kv_chunk_blocks=2,
        kv_load_policy="always",
    )
    run(engine, [LONG])
    evict_device(engine)
    files = sorted(tmp_path.rglob("*.kv"))
    assert files
    for path in files:  # damage the entries of blocks 12 on (the chunks from the 7th)
        data = bytearray(path.read_bytes())
        entry = serde.unpack(engine.store.fmt, bytes.fromhex(path.stem), data)
        if entry.first_block >= 12:
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
    written = engine.stats().store.chunks_written
    out = run(engine, [LONG])[0]
    assert out.token_ids == reference.token_ids
    assert out.num_loaded_tokens == 12 * 4  # what was verified before the damage
    stats = engine.stats()
    assert stats.num_load_rollbacks == 1 and stats.store.tiers["disk"].faults >= 1
    engine.flush()
    # the damaged chunks were recomputed; the store forgot them, so they are written again
    assert engine.stats().store.chunks_written > written
    evict_device(engine)
    assert run(engine, [LONG])[0].num_loaded_tokens == (len(LONG) - 1) // 4 * 4
    engine.close()


def test_park_moves_a_session_to_the_tiers_and_its_next_turn_loads_it():
    chat = [{"role": "user", "content": "Tell me about blocks. " * 4}]
    session = RequestOptions(tenant="alice", session_id="s1")
    engine = fake_engine(kv_host_memory="1MiB", kv_store_min_tokens=8, kv_load_policy="always")
    first = run(engine, [chat], options=session)[0]
    with pytest.raises(SessionNotFound, match="session_id"):
        engine.park("s1", tenant="bob")  # sessions are per tenant
    cached_before = engine.stats().kv.blocks_cached_free
    parked = engine.park("s1", tenant="alice")
    assert parked > 0 and parked % 4 == 0
    assert engine.stats().kv.blocks_cached_free == cached_before - parked // 4
    turn2 = chat + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "?"}]
    out = run(engine, [turn2], options=session)[0]
    assert out.num_loaded_tokens > 0
    assert out.token_ids == run(fake_engine(), [turn2])[0].token_ids
    engine.add_request(turn2, P, session)
    with pytest.raises(SessionBusy, match="in flight"):
        engine.park("s1", tenant="alice")


SYSTEM = "system: You are a careful assistant. Answer briefly, and say where facts come from.\n"
CONVERSATIONS = {
    "a": SYSTEM + "user: What do cats eat when nobody is watching them at night?\nassistant: ",
    "b": SYSTEM + "user: Why do the tides follow the moon and not the sun, mostly?\nassistant: ",
}


@pytest.mark.parametrize("how", ["park", "restart"])
def test_conversations_sharing_a_system_prompt_both_load_their_whole_history(tmp_path, how):
    """Issue 10's clobbering: entries were keyed by their first block, so two conversations
    whose stored chunk starts inside a shared system prompt overwrote each other's, and only
    the last writer loaded its history. Keyed by their last block, both load it all."""
    config = {"kv_store_min_tokens": 8, "kv_load_policy": "always", "kv_chunk_blocks": 8}
    tier = {"kv_host_memory": "4MiB"} if how == "park" else {"kv_disk_path": str(tmp_path)}
    engine = fake_engine(num_blocks=256, **tier, **config)
    firsts = {}
    for name, prompt in CONVERSATIONS.items():
        firsts[name] = run(engine, [prompt], options=RequestOptions(session_id=name))[0]
    if how == "park":
        for name in CONVERSATIONS:
            assert engine.park(name) > 0
        evict_device(engine)
    else:
        engine.close()
        engine = fake_engine(num_blocks=256, **tier, **config)
    for name, prompt in CONVERSATIONS.items():
        evict_device(engine)  # what the other turn left on the device does not count
        turn2 = prompt + firsts[name].text + "\nuser: And then?\nassistant: "
        out = run(engine, [turn2], options=RequestOptions(session_id=name))[0]
        history = (len(prompt) - 1) // 4 * 4  # every full block of the first turn's prompt
        assert out.num_loaded_tokens >= history, (name, out.num_loaded_tokens, history)
        assert out.token_ids == run(fake_engine(), [turn2])[0].token_ids
    engine.close()


def test_admission_errors_are_typed():
    engine = fake_engine(num_blocks=8, max_waiting=1)
    with pytest.raises(ContextLengthExceeded, match="prompt: .* do not fit the KV cache"):
        engine.add_request("x" * 40, P)
    engine.add_request("hello", P)
    with pytest.raises(QueueFullError):
        engine.add_request("again", P)
    with pytest.raises(ValueError, match="retention"):
        engine.add_request("hello", P, RequestOptions(retention="soon"))


def test_text_too_long_for_the_context_is_refused_before_it_is_tokenized():
    engine = fake_engine(max_model_len=64)

    def never(*args, **kwargs):
        raise AssertionError("tokenized")

    engine.tokenizer.encode = engine.tokenizer.encode_chat = never
    with pytest.raises(ContextLengthExceeded, match="prompt: 65 characters .* 64 tokens"):
        engine.add_request("x" * 65, P)
    with pytest.raises(ContextLengthExceeded, match="messages: 70 characters"):
        engine.add_request([{"role": "user", "content": "y" * 70}], P)


def test_stop_strings_and_abort_free_every_block():
    engine = fake_engine()
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    free_run = run(engine, [LONG], params)[0]
    stop = free_run.text[5:7]
    out = run(engine, [LONG], SamplingParams(max_tokens=50, temperature=0, stop=[stop]))[0]
    assert out.finish_reason is FinishReason.STOP and stop not in out.text
    assert out.stop_string == stop and free_run.stop_string is None
    request_id = engine.add_request(LONG, params)
    engine.step()
    engine.abort([request_id])
    assert engine.stats().kv.blocks_used == 0


def test_llm_stream_takes_every_option_generate_takes():
    llm = LLM.__new__(LLM)
    llm.engine = fake_engine(kv_host_memory="1MiB", kv_store_min_tokens=8)
    chat = [{"role": "user", "content": "stream me " * 6}]
    outs = list(llm.stream(chat, P, tenant="alice", session_id="s", retention="1h"))
    assert outs[-1].finished and llm.stats().kv.blocks_kept > 0
    assert llm.park("s", tenant="alice") > 0
    streamed = "".join(o.delta_text for o in outs)
    options = RequestOptions(tenant="alice", session_id="s")
    assert llm.chat(chat, P, options)[0].text == streamed
    with pytest.raises(ValueError, match="tenat: unknown request option"):
        llm.generate("x", P, tenat="alice")


def test_a_block_aligned_prompt_cached_whole_computes_its_last_token_alone():
    """The fake runner reads the last token's slot from the pool: a whole hit that marked a
    row in the pool that is not there would change the answer."""
    prompt = LONG + "!"  # 100 bytes: 25 full blocks of 4
    cold = run(fake_engine(enable_prefix_caching=False), [prompt])[0]
    engine = fake_engine()
    assert run(engine, [prompt])[0].token_ids == cold.token_ids
    before = engine.runner.num_tokens_computed
    again = run(engine, [prompt])[0]
    assert again.num_cached_tokens == 99 and again.token_ids == cold.token_ids
    assert engine.runner.num_tokens_computed - before == 1 + 11  # its last token, 11 decodes

    # a runner that cannot leave a row unwritten: the last block is computed again
    def plain(runner):
        runner.skips_cached_writes = False
        return runner

    other = fake_engine(wrap_runner=plain)
    run(other, [prompt])
    assert run(other, [prompt])[0].num_cached_tokens == 96


def test_the_tier_writer_waits_while_the_engine_steps():
    engine = fake_engine(kv_host_memory="1MiB", kv_store_min_tokens=8)
    writer, seen = engine.store._writer, []
    execute = engine.runner.execute
    engine.runner.execute = lambda out, *a: seen.append(writer._busy) or execute(out, *a)
    run(engine, [LONG])
    assert seen and all(seen) and not writer._busy  # busy while stepping, idle after
