"""The reasoning budget (chat/constraint.py) as kimi-k3-cli and the server enforce it: only the
think channel's text counts, never a marker's tag the model is writing, and under a grammar the
forced closer waits until the grammar can take it (a character half written is finished first)."""
from __future__ import annotations

import numpy as np
import pytest

from gguf_arch.arch import xtml
from ggml_graph_spec.chat.constraint import Constraint, ConstraintPlan
from ggml_graph_spec.chat.grammar import JsonSchema, ReplySpec
from ggml_graph_spec.text.tokenizer import BPETokenizer


@pytest.fixture(scope="module")
def tok(k3_tiny_gguf) -> BPETokenizer:
    return BPETokenizer.from_gguf(k3_tiny_gguf)


def _byte_token(tok: BPETokenizer, byte: int) -> int:
    return next(i for i in range(tok.vocab_size) if not tok.is_special(i) and tok.token_bytes(i) == bytes([byte]))


def _forced(c: Constraint, n_vocab: int) -> int | None:
    """The one token the constraint allows now, or None when it allows more than one."""
    allowed = np.flatnonzero(np.isfinite(c.mask(np.zeros(n_vocab, np.float32))))
    return int(allowed[0]) if len(allowed) == 1 else None


def test_a_marker_the_model_writes_is_not_thinking(tok):
    c = Constraint(ConstraintPlan.build(tok, ReplySpec("think"), budget=2), tok)
    word = tok.encode(" word", add_bos=False)[0]
    c.accept(word)  # one think token of two
    for t in tok.encode(xtml.closing(xtml.THINK), add_bos=False)[:-1]:  # the model closes the think itself
        c.accept(t)
        assert _forced(c, tok.vocab_size) is None  # inside its tag: not counted, nothing forced
    c.accept(tok.special_id(xtml.SEP))
    assert not c.in_think and _forced(c, tok.vocab_size) is None


def test_under_a_grammar_the_closer_waits_for_a_half_written_character(tok):
    plan = ConstraintPlan.build(tok, ReplySpec("think", response=JsonSchema({"type": "object"})), budget=1)
    c = Constraint(plan, tok)
    c.accept(_byte_token(tok, 0xC3))  # the budget's one token: the first byte of "é"
    assert _forced(c, tok.vocab_size) is None  # <|close|> now would break the grammar's UTF-8 text
    c.accept(_byte_token(tok, 0xA9))
    closer = tok.encode(xtml.closing(xtml.THINK), add_bos=False)
    for t in closer:  # the character is whole: the closer is forced, every token of it
        assert _forced(c, tok.vocab_size) == t
        c.accept(t)
    assert c.error == "" and not c.in_think
