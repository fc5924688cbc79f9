"""The closing look-ahead's cost (chat/closing.py), held where it is cheap without changing what it
finds: its way to the end computes a mask only where the grammar forces no token, and finds the
way a mask at every step finds; a mask becomes one bool per token by numpy's unpackbits.
bench/agents.py measures both against a decode step."""
from __future__ import annotations

import numpy as np
import pytest

from gguf_arch.arch import xtml
from ggml_graph_spec.chat.closing import Bits, EndInTime
from ggml_graph_spec.chat.constraint import ConstraintPlan
from ggml_graph_spec.chat.grammar import JsonSchema, ReplySpec
from ggml_graph_spec.chat.tools import parse_tool_choice, parse_tools

TOOLS = parse_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"type": "string", "enum": ["celsius", "kelvin"]}},
    "required": ["city", "days"]}}}])
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {
    "type": "array", "items": {"type": "string"}}}, "required": ["name", "tags"]}
CALL = (xtml.opening(xtml.TOOLS) + xtml.opening(xtml.CALL, tool="get_weather", index="1")
        + xtml.opening(xtml.ARGUMENT, key="city", type="string") + "Paris" + xtml.closing(xtml.ARGUMENT)
        + xtml.opening(xtml.ARGUMENT, key="days", type="number") + "3" + xtml.closing(xtml.ARGUMENT)
        + xtml.closing(xtml.CALL) + xtml.closing(xtml.TOOLS) + xtml.closing(xtml.MESSAGE))
ANSWER = xtml.closing(xtml.THINK) + xtml.opening(xtml.RESPONSE)
CASES = {"tools": (ReplySpec("think", TOOLS, parse_tool_choice("required", TOOLS)),
                   "plan" + ANSWER + xtml.closing(xtml.RESPONSE) + CALL),
         "json": (ReplySpec("think", response=JsonSchema(SCHEMA)),
                  "plan" + ANSWER + '{"name": "Ann", "tags": ["a", "b"]}' + xtml.closing(xtml.RESPONSE))}


def masked_way(end: EndInTime, matcher, cap: int, n_vocab: int) -> tuple[int, int]:
    """The way's length as found with a mask at every step (the look-ahead before it skipped the
    mask of forced steps), and how many of its steps the grammar forced no token at."""
    shadow, bits, n, unforced = matcher.deep_copy(), Bits(n_vocab), 0, 0
    while n < cap and not (shadow.is_stopped() or shadow.is_error()):
        bits.fill(shadow)
        unforced += not shadow.compute_ff_tokens()
        choice = end.policy(shadow, bits)
        if choice is None:
            break
        n += 1
        if choice == end._eos and shadow.is_accepting():
            break
        shadow.consume_token(choice)
    return n, unforced


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_way_to_the_end_computes_a_mask_only_where_nothing_is_forced(tok, case, monkeypatch):
    spec, text = CASES[case]
    matcher = ConstraintPlan.build(tok, spec).full
    end, masks = EndInTime(tok, tok.vocab_size), []
    fill = Bits.fill
    monkeypatch.setattr(Bits, "fill", lambda self, m: masks.append(1) or fill(self, m))
    steps = forced = 0
    for token in tok.encode(text, add_bos=False):  # every state of a valid reply
        masks.clear()
        found = end.shortest(matcher, 200)
        computed = len(masks)
        want, unforced = masked_way(end, matcher, 200, tok.vocab_size)
        assert found == want and computed == unforced
        steps, forced = steps + want, forced + want - unforced
        assert matcher.consume_token(token)
    assert forced > steps // 4  # most of a way is markup the grammar spells: those masks are saved


def test_a_mask_is_unpacked_by_numpy_in_one_call(monkeypatch):
    """Looking each byte's bits up in a table took 18x unpackbits' time at 163,840 tokens
    (bench/agents.py); the bits are the same (test_constraint.py checks every one)."""
    calls = []
    unpack = np.unpackbits
    monkeypatch.setattr(np, "unpackbits", lambda *a, **k: calls.append(1) or unpack(*a, **k))
    b = Bits(163_840)
    b.words[::3] = -1
    allowed = b.array()
    assert len(calls) == 1 and allowed.dtype == bool and allowed.size == 163_840 and allowed[:32].all()
