"""Conversation mode: each turn evaluates only its new tokens on top of the caches, replies stop at
the turn end, cut replies are closed; what is shown of a reply; the input reader."""
from __future__ import annotations

import io

import numpy as np
import pytest

from gguf_arch.arch.chat_template import K3_CHAT_TEMPLATE
from ggml_graph_spec.runner.chat import Conversation, LineReader
from ggml_graph_spec.text.chat_template import ChatTemplate
from tests.support.reply_filter import ReplyFilter
from ggml_graph_spec.generation.events import StopRules, Timings
from ggml_graph_spec.runner.interrupt import Interrupt
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.generation.sampling import Sampler, SamplingParams
from ggml_graph_spec.text.tokenizer import BPETokenizer

from tests.support.reference import LOGITS_ATOL

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"


class Recorded:
    """A Model whose model calls for sequence 0 are recorded (tokens in, last logits out)."""

    def __init__(self, model: Model) -> None:
        self.model, self.calls, self.last = model, [], None
        self._decode = model.decode
        model.decode = self._record

    def _record(self, batch, logits="last"):
        out = self._decode(batch, logits)
        self.calls.append([int(t) for t in dict(batch)[0]])
        self.last = out[0] if logits == "last" else out[0][-1]
        return out


@pytest.fixture(scope="module")
def tokenizer(k3_tiny_gguf) -> BPETokenizer:
    return BPETokenizer.from_gguf(k3_tiny_gguf)


@pytest.fixture
def model(k3_tiny_gguf):
    m = Model.load(k3_tiny_gguf, n_ctx=512, exact_experts=True, n_threads=2)
    yield m
    m.close()


def _conversation(model: Model, tokenizer: BPETokenizer, eog: set[int], n_predict: int) -> Conversation:
    template = ChatTemplate(K3_CHAT_TEMPLATE, "test", tokenizer, {"thinking": False})
    return Conversation(model, tokenizer, Sampler(SamplingParams(temp=0.0)), StopRules(frozenset(eog), n_predict),
                        template)


def _turn_text(user: str) -> str:
    return f'{OPEN}message role="user"{SEP}{user}{CLOSE}message{SEP}{END}{OPEN}message role="assistant"{SEP}{OPEN}response{SEP}'


def test_each_turn_evaluates_only_its_new_tokens_on_the_carried_caches(model, tokenizer, k3_tiny_gguf):
    rec = Recorded(model)
    conv = _conversation(model, tokenizer, {tokenizer.eos_id}, n_predict=5)
    first = conv.turn("Hello", io.StringIO(), Timings())
    assert first.reason == "n_predict" and len(first.tokens) == 5
    assert rec.calls[0] == tokenizer.encode(_turn_text("Hello"))  # thinking off: no effort message
    assert [len(c) for c in rec.calls[1:]] == [1] * 4  # the 5th token is sampled, not yet evaluated
    n_first = len(rec.calls)
    conv.turn("Again", io.StringIO(), Timings())
    # Turn 2 starts with the end of reply 1: its last sampled token, then EOS to close the cut turn.
    assert rec.calls[n_first] == [first.tokens[-1], tokenizer.eos_id] + tokenizer.encode(_turn_text("Again"))
    history = [t for call in rec.calls for t in call]
    assert model.n_past == len(history)
    fresh = Model.load(k3_tiny_gguf, n_ctx=512, exact_experts=True, n_threads=2)
    try:
        whole = fresh.eval(history)[-1]  # the whole conversation in one prefill, no carried caches
    finally:
        fresh.close()
    assert np.max(np.abs(whole - rec.last)) <= LOGITS_ATOL


def test_a_reply_stops_at_the_turn_end_and_the_next_turn_starts_after_it(model, tokenizer):
    rec = Recorded(model)
    probe = _conversation(model, tokenizer, set(), n_predict=3).turn("Hi", io.StringIO(), Timings())
    model.reset()
    # The third greedy token declared the turn end: the reply ends after two, without printing it.
    turn_end = probe.tokens[2]
    conv = _conversation(model, tokenizer, {turn_end}, n_predict=20)
    out = io.StringIO()
    reply = conv.turn("Hi", out, Timings())
    assert reply.reason == "eog" and reply.tokens == probe.tokens[:3]
    assert reply.pending == turn_end and out.getvalue() == reply.text
    rec.calls.clear()
    conv.turn("Next", io.StringIO(), Timings())
    assert rec.calls[0][:1] == [turn_end] and tokenizer.eos_id not in rec.calls[0][:2]


def test_an_interrupted_reply_is_closed_with_eos(model, tokenizer):
    rec = Recorded(model)
    conv = _conversation(model, tokenizer, {tokenizer.eos_id}, n_predict=50)
    interrupt = Interrupt()
    interrupt.requested = True  # as after a Ctrl-C during the prefill: nothing sampled
    reply = conv.turn("Hi", io.StringIO(), Timings(), interrupt)
    assert reply.reason == "interrupted" and reply.tokens == [] and reply.pending is None
    conv.turn("Hi again", io.StringIO(), Timings())
    assert rec.calls[1][0] == tokenizer.eos_id


def test_the_reply_filter_hides_special_tokens_and_tag_markup(tokenizer):
    ids = tokenizer.encode(f"Dover{CLOSE}response{SEP}{CLOSE}message{SEP}", add_bos=False)
    show = ReplyFilter(tokenizer)
    shown = tokenizer.decode([t for t in ids if show(t)])
    assert shown == "Dover"


@pytest.mark.parametrize("text, lines", [
    ("one\ntwo\n", ["one", "two"]),
    ("first \\\nsecond\nthird", ["first \nsecond", "third"]),
    ("last\\\n", ["last"]),
    ("", []),
])
def test_the_line_reader_joins_continued_lines_and_ends_at_eof(text, lines):
    reader = LineReader(io.StringIO(text), io.StringIO())
    got = []
    while (line := reader.read()) is not None:
        got.append(line)
    assert got == lines
