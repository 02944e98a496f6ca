"""Shared by the tokenizer tests: one text through kvwise's tokenizer and the reference's."""

from __future__ import annotations


def assert_same_as(tok, ref, text: str) -> None:
    """``tok`` encodes ``text`` to ``ref``'s ids (with and without special tokens) and decodes
    those ids to ``ref``'s text (skipping special tokens or not)."""
    for add_special_tokens in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        assert ids == ref.encode(text, add_special_tokens=add_special_tokens), add_special_tokens
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            )
