"""kimi-k3-cli's agent flags: -j/-jf and --grammar/--grammar-file hold a completion's whole text,
or each chat reply's answer, to a schema or a grammar (sampled at --temp 1 over several seeds on
the random-weight fixture: only the constraint makes the text valid); --reasoning-format none
prints what the conversation printed before the thinking was told apart; a bad schema or grammar
is one error line before anything is loaded."""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import jsonschema
import pytest

from gguf_arch.arch.chat_template import K3_CHAT_TEMPLATE
from gguf_arch.errors import EXIT_BAD_INPUT
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.generation.events import StopRules
from ggml_graph_spec.generation.generate import generate
from ggml_graph_spec.generation.sampling import Sampler, SamplingParams
from ggml_graph_spec.runner.cli import main
from ggml_graph_spec.text.chat_template import ChatTemplate
from tests.support.reply_filter import ReplyFilter
from tests.support.cli import NO_GGML
from tests.support.paths import REPO

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
          "required": ["name", "n"]}
GBNF = 'root ::= answer end\nanswer ::= "yes" | "no" | "maybe"\nend ::= "." | "!"\n'
# -n and -c well above a reply's length: the grammar's look-ahead to a valid end (chat/closing.py)
# costs many masks per token, and runs only within 256 tokens of a limit.
RUN = ("-c", "1024", "-n", "400", "-t", "2", "--exact-experts", "--temp", "1")
SEEDS = (1, 2, 3)


def _cli(capsys, monkeypatch, *argv, stdin: str = "") -> str:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_a_json_schema_holds_a_whole_completion(capsys, monkeypatch, k3_tiny_gguf, seed):
    out = _cli(capsys, monkeypatch, "-m", k3_tiny_gguf, "-p", "The lighthouse keeper", "--no-display-prompt",
               "-s", seed, *RUN, "-j", json.dumps(SCHEMA))
    jsonschema.validate(json.loads(out), SCHEMA)


@pytest.mark.parametrize("seed", SEEDS)
def test_in_a_conversation_each_answer_is_held_to_the_schema(capsys, monkeypatch, tmp_path, k3_tiny_gguf, seed):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA), encoding="utf-8")
    saved = tmp_path / "c.json"
    # Thinking off, then on with a budget of 3 think tokens: the grammar takes the answer after it.
    for reasoning in (["-rea", "off"], ["--reasoning-budget", "3"]):
        _cli(capsys, monkeypatch, "-m", k3_tiny_gguf, "-cnv", "-s", seed, *RUN, "-jf", schema, *reasoning,
             stdin=f"Hello there\nAnd then?\n/save {saved}\n")
        answers = [m["content"] for m in json.loads(saved.read_text()) if m["role"] == "assistant"]
        assert len(answers) == 2
        for answer in answers:
            jsonschema.validate(json.loads(answer), SCHEMA)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_gbnf_grammar_file_holds_a_completion_and_a_chat_answer(capsys, monkeypatch, tmp_path, k3_tiny_gguf, seed):
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text(GBNF, encoding="utf-8")
    out = _cli(capsys, monkeypatch, "-m", k3_tiny_gguf, "-p", "Is it?", "--no-display-prompt", "-s", seed,
               *RUN, "--grammar-file", grammar)
    assert re.fullmatch(r"(yes|no|maybe)[.!]\n", out), out
    out = _cli(capsys, monkeypatch, "-m", k3_tiny_gguf, "-cnv", "-rea", "off", "-s", seed, *RUN,
               "--grammar", GBNF, stdin="Is it?\n")
    assert re.fullmatch(r"(yes|no|maybe)[.!]\n", out), out


def _before_reasoning_was_parsed(gguf, turns: list[str]) -> list[str]:
    """The conversation as the runner ran it before the think channel was told apart: the reply
    shown through the template's filter (special tokens and tags hidden, the thinking inline)
    and kept in the history as its whole text."""
    model = Model.load(gguf, n_ctx=1024, exact_experts=True, n_threads=2)
    try:
        tok = model.tokenizer
        template, sampler = ChatTemplate(K3_CHAT_TEMPLATE, "test", tok, {}), Sampler(SamplingParams(temp=0.0))
        messages, rendered, carry, shown = [], "", [], []
        for text in turns:
            messages.append({"role": "user", "content": text})
            full = template.render(messages, add_generation_prompt=True)
            new = full[len(rendered):] if full.startswith(rendered) else full
            ids = carry + tok.encode(new, add_bos=None if not rendered else False)
            sampler.reset()
            gen = generate(model, ids, sampler, StopRules(frozenset({tok.eos_id}), 6), show=ReplyFilter(tok))
            shown.append("".join(e.text for e in gen))
            reply = gen.reply
            carry = [reply.pending] + ([tok.eos_id] if reply.reason != "eog" else [])
            messages.append({"role": "assistant", "content": reply.text})
            rendered = template.render(messages, add_generation_prompt=False)
        return shown
    finally:
        model.close()


def test_reasoning_format_none_prints_what_the_conversation_printed_before(capsys, monkeypatch, k3_tiny_gguf):
    out = _cli(capsys, monkeypatch, "-m", k3_tiny_gguf, "-cnv", "-n", "6", "--temp", "0", "-c", "1024", "-t", "2",
               "--exact-experts", "--reasoning-format", "none", stdin="Hello there\nAnd then?\n")
    before = _before_reasoning_was_parsed(k3_tiny_gguf, ["Hello there", "And then?"])
    assert out == "".join(r + "\n" for r in before)
    assert "[Start thinking]" not in out


_MANY = NO_GGML + """
import contextlib, io, json, sys
from ggml_graph_spec.runner.cli import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    print(json.dumps([rc, out.getvalue(), err.getvalue()]), flush=True)
"""


def test_a_bad_schema_grammar_or_reasoning_flag_is_one_error_line_before_loading(tmp_path, k3_tiny_gguf):
    (tmp_path / "not.json").write_text("{nope", encoding="utf-8")
    (tmp_path / "bogus.json").write_text('{"type": "bogus"}', encoding="utf-8")
    (tmp_path / "undefined.gbnf").write_text("root ::= answer\n", encoding="utf-8")
    cases = [
        (["-p", "x", "-jf", str(tmp_path / "absent.json")], f"-jf/--json-schema-file {tmp_path / 'absent.json'}: no such"),
        (["-p", "x", "-jf", str(tmp_path / "not.json")], "not.json: invalid JSON"),
        (["-p", "x", "-jf", str(tmp_path / "bogus.json")], "bogus.json: failed to compile JSON schema: Invalid type"),
        (["-p", "x", "-j", "[1]"], "-j/--json-schema: a JSON schema is an object (or true), got list"),
        (["-p", "x", "-j", "{"], "-j/--json-schema: not JSON"),
        (["-p", "x", "--grammar", 'root ::= "yes'], "--grammar: not a GBNF grammar"),
        (["-p", "x", "--grammar-file", str(tmp_path / "undefined.gbnf")], "not a GBNF grammar: Rule 'answer' not found"),
        (["-p", "x", "-j", "{}", "--grammar", 'root ::= "a"'], "not allowed with argument"),
        (["-p", "x", "-j", "{}", "--ignore-eos"], "--ignore-eos cannot be used with a grammar"),
        (["-cnv", "--reasoning-budget", "-2"], "--reasoning-budget must be -1 (unlimited), 0 or"),
        (["-cnv", "-rea", "off", "--reasoning-effort", "high"], "--reasoning-effort high and -rea off disagree"),
        (["-no-cnv", "-p", "x", "--reasoning-budget", "3"], "--reasoning-budget applies to a conversation"),
        (["-cnv", "--chat-template-kwargs", '{"thinking": true}', "-rea", "off"], "sets thinking to true"),
        (["--perplexity", "-f", str(tmp_path / "not.json"), "-j", "{}"], "not to --perplexity"),
    ]
    argvs = [["-m", str(k3_tiny_gguf), "-n", "1", "-c", "64", *argv] for argv, _needle in cases]
    res = subprocess.run([sys.executable, "-c", _MANY, json.dumps(argvs)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    results = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(results) == len(cases), res.stderr[-2000:]  # none reached ggml (exit 99)
    for (argv, needle), (rc, out, err) in zip(cases, results):
        assert (rc, out) == (EXIT_BAD_INPUT, ""), (argv, err)
        assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, (argv, err)
