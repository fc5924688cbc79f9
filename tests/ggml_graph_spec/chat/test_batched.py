"""One grammar per sequence in a batched step: on the exact path, greedy, each constrained sequence
of a batch of 8 (each with its own grammar, some with none) gives the tokens of its run alone, and
each constrained reply validates."""
from __future__ import annotations

import json

import jsonschema
import pytest

from ggml_graph_spec.chat.constraint import Constraint, ConstraintPlan
from ggml_graph_spec.chat.grammar import JsonSchema, ReplySpec
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.engine.options import LoadOptions
from ggml_graph_spec.generation.batch import BatchGenerator
from ggml_graph_spec.generation.events import StopRules
from ggml_graph_spec.generation.sampling import Sampler, SamplingParams

N_CTX_SEQ, MAX_TOKENS = 256, 80
SCHEMAS = [None, {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
           {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 2},
           {"type": "object", "properties": {"ok": {"type": "boolean"}, "why": {"type": "string", "maxLength": 9}},
            "required": ["ok", "why"]}]


def _requests(tok):
    """8 prompts ending in the response channel's opener, each with a schema (or none)."""
    out = []
    for i in range(8):
        text = f'<|open|>message role="user"<|sep|>Question {i}: give it as JSON.<|close|>message<|sep|>' \
               '<|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
        out.append((tok.encode(text, add_bos=True), SCHEMAS[i % len(SCHEMAS)]))
    return out


def _run(model, reqs, seqs) -> dict[int, list[int]]:
    gen, tok = BatchGenerator(model), model.tokenizer
    live = {}
    for seq, (prompt, schema) in zip(seqs, reqs):
        plan = ConstraintPlan.build(tok, ReplySpec("response", response=JsonSchema(schema))) if schema else None
        r = gen.add(seq, prompt, Sampler(SamplingParams(temp=0.0)), StopRules(frozenset({tok.eos_id}), MAX_TOKENS),
                    constraint=Constraint(plan, tok) if plan else None)
        live[seq] = r
    while gen.active:
        gen.step()
    return {seq: r.reply.tokens for seq, r in live.items()}


@pytest.fixture(scope="module")
def model(k31pro_tiny_gguf):
    m = Model.load(k31pro_tiny_gguf, LoadOptions(n_ctx=8 * N_CTX_SEQ, n_seq=8, exact_experts=True, n_threads=2))
    yield m
    m.close()


def test_each_constrained_sequence_of_a_batch_of_8_equals_its_run_alone(model):
    tok = model.tokenizer
    reqs = _requests(tok)
    batched = _run(model, reqs, range(8))
    for i, req in enumerate(reqs):
        model.reset()
        alone = _run(model, [req], [0])[0]
        assert batched[i] == alone, f"sequence {i}"
        schema = req[1]
        if schema is not None:
            assert alone[-1] == tok.eos_id
            text = tok.decode(alone).split("<|close|>response")[0]
            jsonschema.validate(json.loads(text), schema)
