"""A chat prompt repeating an earlier answer gets the answer's own token ids
(``RecentAnswers`` + ``Tokenizer.encode_chat(answers=...)``): the previous turn's prompt and
answer ids exactly, then the new messages; per tenant; the canonical tokenization where no
answer is known or the text differs."""

from __future__ import annotations

from kvwise.engine.prompts import RecentAnswers
from kvwise.engine.tokenizer import Tokenizer
from kvwise.models.default import default_model_path


def test_a_repeated_answer_keeps_its_ids():
    tok = Tokenizer.from_path(default_model_path())
    turn1 = [{"role": "user", "content": "Spell it."}]
    prompt_ids = tok.encode_chat(turn1)
    answer = "}}"
    odd = tok.encode("}", add_special_tokens=False) * 2  # not how "}}" tokenizes
    assert odd != tok.encode(answer, add_special_tokens=False)
    answers = RecentAnswers()
    answers.record("alice", answer, odd)
    turn2 = turn1 + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Again."},
    ]
    got = tok.encode_chat(turn2, answers=answers.lookup("alice"))
    assert got[: len(prompt_ids) + 2] == prompt_ids + odd  # the last turn's ids, as generated
    assert tok.decode(got, skip_special_tokens=False) == tok.apply_chat_template(turn2)
    canonical = tok.encode_chat(turn2)
    assert tok.encode_chat(turn2, answers=answers.lookup("bob")) == canonical != got
    other = turn1 + [{"role": "assistant", "content": "}} "}, {"role": "user", "content": "Again."}]
    assert tok.encode_chat(other, answers=answers.lookup("alice")) == tok.encode_chat(other)


def test_the_map_is_bounded():
    answers = RecentAnswers(capacity=2)
    for i in range(3):
        answers.record("t", f"a{i}", [i])
    find = answers.lookup("t")
    assert find("a0") is None and find("a1") == (1,) and find("a2") == (2,)
