"""Constraints hold whatever the weights: random logits (any model's) under each constraint give a
reply that ends within its token limit and validates; the reasoning budget closes the think
channel; the lazy tools grammar starts at `<|open|>`; with no tools allowed no tools section opens."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from gguf_arch.arch.xtml import OPEN, closing
from ggml_graph_spec.chat.constraint import Constraint, ConstraintPlan
from ggml_graph_spec.chat.grammar import JsonSchema, ReplySpec
from ggml_graph_spec.chat.reply import ReplyParser
from ggml_graph_spec.chat.tools import parse_tool_choice, parse_tools

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    "home": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                   "pattern": "^[0-9]{5}$"}},
             "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "home"]}
TOOLS = parse_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object", "properties": {
            "site": {"type": "string"}}}}, "required": ["query"]}}},
])
ROOM = 400  # tokens: the tiny vocabulary (656 ranks) spells the markup's names in several tokens each
SEEDS = range(6)


def walk(tok, plan: ConstraintPlan, seed: int, room: int = ROOM, scale: float = 4.0) -> list[int]:
    """A reply sampled at temperature 1 from random logits under the plan's constraint."""
    rng = np.random.default_rng(seed)
    c, out = Constraint(plan, tok), []
    while len(out) < room:
        logits = rng.normal(size=tok.vocab_size).astype(np.float32) * scale
        masked = c.mask(logits, room - len(out))
        p = np.exp(masked - masked.max())
        token = int(rng.choice(p.size, p=p / p.sum()))
        c.accept(token)
        out.append(token)
        if token == tok.eos_id:
            break
    assert not c.error
    return out


def parsed(tok, start: str, tokens: list[int], tools=TOOLS):
    p = ReplyParser(tok, start, tools)
    for t in tokens:
        p.feed(t)
    return p.finish()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("choice", ["required", "named", "single"])
def test_required_named_and_single_calls_end_valid_within_the_limit(tok, choice, seed):
    mode = {"required": "required", "named": {"type": "function", "function": {"name": "search"}},
            "single": "required"}[choice]
    spec = ReplySpec("think", TOOLS, parse_tool_choice(mode, TOOLS, parallel=choice != "single"))
    tokens = walk(tok, ConstraintPlan.build(tok, spec, budget=16), seed)
    assert tokens[-1] == tok.eos_id, tok.decode(tokens)
    reply = parsed(tok, "think", tokens)
    assert reply.tool_calls and not reply.error and not reply.open_call
    if choice == "named":
        assert {c.name for c in reply.tool_calls} == {"search"}
    if choice == "single":
        assert len(reply.tool_calls) == 1
    for c in reply.tool_calls:
        schema = next(t for t in TOOLS if t.name == c.name).parameters
        jsonschema.validate(json.loads(c.arguments), schema)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("room", [120, ROOM])
def test_a_json_schema_reply_ends_valid_within_the_limit(tok, seed, room):
    spec = ReplySpec("response", response=JsonSchema(SCHEMA))
    tokens = walk(tok, ConstraintPlan.build(tok, spec), seed, room)
    assert tokens[-1] == tok.eos_id and len(tokens) <= room
    jsonschema.validate(json.loads(parsed(tok, "response", tokens).content), SCHEMA)


EMAIL = {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
         "required": ["email"]}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("room", [40, 120])
def test_an_unbounded_part_before_a_required_literal_still_ends_in_time(tok, seed, room):
    """Near the limit the steered reply takes the way the look-ahead counted, even where the
    grammar spells nothing: a model that writes letters forever inside `[a-z]+` (before the
    pattern's required `@`) is not left to choose there, or it never reaches the `@`."""
    letters = np.array([not tok.is_special(i) and tok.token_bytes(i).isalpha() and tok.token_bytes(i).islower()
                        for i in range(tok.vocab_size)])
    rng = np.random.default_rng(seed)
    c, out = Constraint(ConstraintPlan.build(tok, ReplySpec("response", response=JsonSchema(EMAIL))), tok), []
    while len(out) < room and (not out or out[-1] != tok.eos_id):
        logits = (rng.normal(size=tok.vocab_size) + 12.0 * letters).astype(np.float32)
        t = int(np.argmax(c.mask(logits, room - len(out))))
        c.accept(t)
        out.append(t)
    assert out[-1] == tok.eos_id and not c.error, tok.decode(out)
    jsonschema.validate(json.loads(parsed(tok, "response", out).content), EMAIL)


def test_the_reasoning_budget_closes_the_think_channel_after_its_tokens(tok):
    plan = ConstraintPlan.build(tok, ReplySpec("think"), budget=5)
    c, rng = Constraint(plan, tok), np.random.default_rng(0)
    closer = tok.encode(closing("think"), add_bos=False)
    think = [i for i in range(tok.vocab_size) if not tok.is_special(i) and tok.token_bytes(i).isascii()]
    out = []
    for _ in range(5 + len(closer)):
        logits = np.full(tok.vocab_size, -1e9, dtype=np.float32)
        logits[rng.choice(think)] = 0.0  # a model that would think forever
        t = int(np.argmax(c.mask(logits)))
        c.accept(t)
        out.append(t)
    assert out[5:] == closer and not c.in_think


def test_the_budget_never_closes_the_channel_inside_a_character(tok):
    plan = ConstraintPlan.build(tok, ReplySpec("think"), budget=1)
    c, lead = Constraint(plan, tok), tok.encode("é", add_bos=False, allow_special=False)
    assert len(lead) == 2  # a two-byte character spelled byte by byte: the channel may close after both
    c.accept(lead[0])
    assert np.isfinite(c.mask(np.zeros(tok.vocab_size, dtype=np.float32))).all()
    c.accept(lead[1])
    assert np.isfinite(c.mask(np.zeros(tok.vocab_size, dtype=np.float32))).sum() == 1


def test_a_zero_budget_closes_it_at_once(tok):
    c = Constraint(ConstraintPlan.build(tok, ReplySpec("think"), budget=0), tok)
    first = tok.encode(closing("think"), add_bos=False)[0]
    assert int(np.argmax(c.mask(np.zeros(tok.vocab_size, dtype=np.float32)))) == first


def test_the_lazy_tools_grammar_starts_only_at_a_marker_after_the_think_channel(tok):
    spec = ReplySpec("think", TOOLS, parse_tool_choice("auto", TOOLS))
    plan = ConstraintPlan.build(tok, spec)
    assert plan.lazy is not None and plan.full is None
    c, free = Constraint(plan, tok), np.zeros(tok.vocab_size, dtype=np.float32)
    for t in tok.encode("x" + closing("think") + "<|open|>response<|sep|>abc", add_bos=False):
        assert np.isfinite(c.mask(free)).all()  # free text: nothing masked
        c.accept(t)
    c.accept(tok.special_id(OPEN))
    allowed = np.isfinite(c.mask(free))
    assert 0 < allowed.sum() < tok.vocab_size  # now the tools section's grammar holds


def test_without_allowed_tools_no_tools_section_opens(tok):
    plan = ConstraintPlan.build(tok, ReplySpec("response", TOOLS, parse_tool_choice("none", TOOLS)))
    c, logits = Constraint(plan, tok), np.zeros(tok.vocab_size, dtype=np.float32)
    assert plan.ban_open and np.isneginf(c.mask(logits)[tok.special_id(OPEN)])
    assert ConstraintPlan.build(tok, ReplySpec("response")) is not None  # no tools declared: the same guard


def test_an_ordinary_token_starting_with_0xff_is_no_special_token_for_the_grammar_engine(tok):
    from ggml_graph_spec.chat.vocab import STAND_IN, _Wrapped

    class Vocab:  # the tiny vocabulary with one merge that starts with the raw byte 0xFF
        def __init__(self):
            self.vocab_size, self.eos_id, self.bos_id = tok.vocab_size, tok.eos_id, tok.bos_id

        def token_bytes(self, i):
            return b"\xff\x80" if i == 300 else tok.token_bytes(i)

        def is_special(self, i):
            return tok.is_special(i)

    w = _Wrapped(Vocab())
    assert w.tokens[300] == STAND_IN + b"\x80" and w.tokens[255] == b"\xff"
    assert 300 not in w.special_token_ids and all(w.tokens[i].startswith(b"\xff") for i in w.special_token_ids)


def test_the_mask_lookup_gives_every_tokens_bit(tok):
    from ggml_graph_spec.chat.closing import Bits

    b = Bits(tok.vocab_size)
    rng = np.random.default_rng(3)
    b.words[:] = rng.integers(-2**31, 2**31, size=b.words.size, dtype=np.int64).astype(np.int32)
    want = np.unpackbits(b.words.view(np.uint8), bitorder="little", count=tok.vocab_size).astype(bool)
    assert (b.array() == want).all() and all((t in b) == want[t] for t in range(0, tok.vocab_size, 7))
