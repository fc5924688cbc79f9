"""The agent flags, as llama.cpp names them, defined once for kimi-k3-cli and kimi-k3-server:

* what constrains the output (`add_grammar_arguments`): -j/--json-schema, -jf/--json-schema-file,
  --grammar, --grammar-file (GBNF, llama.cpp's grammars/*.gbnf syntax, or llguidance's Lark);
* how a reply reasons (`add_reasoning_arguments`): --reasoning-format, --reasoning-budget,
  --reasoning-budget-message, -rea/--reasoning, --reasoning-effort.

`reply_options(a)` turns them into ReplyOptions, checked before any model is loaded: a schema or
a grammar that cannot be used is one UsageError line (llguidance validates it without the
vocabulary; compiling it against the vocabulary comes later). ReplyOptions' reasoning fields are
named as the server's AgentDefaults names its own (server/agent.py), so a server builds those from
the same parsed flags; `template_variables` puts -rea and --reasoning-effort into the chat
template's variables (K3's `thinking` and `thinking_effort`).
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf_arch.io.console import UsageError
from gguf_arch.io.jsonfile import not_unicode, read_json, read_text

from ..chat.constraint import Constraint, ConstraintPlan, GrammarError, first_error_line
from ..chat.grammar import JsonSchema, Lark, ReplySpec, Response, text_grammar
from ..chat.reasoning import EFFORTS, MAX_BUDGET, REASONING_FORMATS
from ..text.tokenizer import BPETokenizer

# The flags that only mean something for a chat reply: given, they make kimi-k3-cli's run a
# conversation (as -sys does); with -no-cnv they are refused.
REASONING_FLAGS = (("--reasoning-format", "reasoning_format"), ("--reasoning-budget", "reasoning_budget"),
                   ("--reasoning-budget-message", "reasoning_budget_message"), ("-rea/--reasoning", "reasoning"),
                   ("--reasoning-effort", "reasoning_effort"))


@dataclass(frozen=True)
class ReplyOptions:
    """What the agent flags ask of every reply."""

    reasoning_format: str = "auto"
    reasoning_budget: int = -1  # think tokens before `<|close|>think<|sep|>` is forced; -1: no budget
    budget_message: str = ""  # written into the think channel just before the forced close
    thinking: bool | None = None  # -rea on/off; None: the template's default
    effort: str | None = None  # K3's thinking_effort; None: the template's default
    response: Response = None  # -j/-jf/--grammar/--grammar-file: what the reply's answer must be

    @property
    def inline(self) -> bool:
        """reasoning_format none: the think channel's text is printed as the reply's text."""
        return self.reasoning_format == "none"


def add_grammar_arguments(p: argparse.ArgumentParser) -> None:
    """-j, -jf, --grammar, --grammar-file: at most one of them."""
    g = p.add_argument_group("constrained output (llama.cpp's grammar flags; at most one)")
    one = g.add_mutually_exclusive_group()
    whole = ("a completion's whole text, or each chat reply's answer (its response channel)")
    one.add_argument("-j", "--json-schema", metavar="SCHEMA",
                     help=f"a JSON schema (text) that {whole} must validate against, e.g. '{{}}' for any JSON object")
    one.add_argument("-jf", "--json-schema-file", type=Path, metavar="FILE", help="-j with the schema read from FILE")
    one.add_argument("--grammar", metavar="GRAMMAR",
                     help=f"a GBNF grammar (llama.cpp's grammars/*.gbnf syntax; or llguidance's Lark) that {whole} "
                          "must match")
    one.add_argument("--grammar-file", type=Path, metavar="FILE", help="--grammar with the grammar read from FILE")


def add_reasoning_arguments(p: argparse.ArgumentParser) -> None:
    """--reasoning-format, --reasoning-budget, --reasoning-budget-message, -rea, --reasoning-effort."""
    g = p.add_argument_group("reasoning (K3's think channel)")
    g.add_argument("--reasoning-format", choices=REASONING_FORMATS, default=None, metavar="FORMAT",
                   help="how the thinking is given back: auto, deepseek or deepseek-legacy: apart from the answer "
                        "(kimi-k3-cli: between [Start thinking] and [End thinking]; a server: reasoning_content, "
                        "deepseek-legacy in the content too); none: inline, as the reply's text (default: auto)")
    g.add_argument("--reasoning-budget", type=int, default=None, metavar="N",
                   help="think tokens a reply may take before <|close|>think<|sep|> is forced: -1 unlimited (the "
                        "default), 0 an immediate end")
    g.add_argument("--reasoning-budget-message", default=None, metavar="MESSAGE",
                   help="text written into the thinking just before a budget closes it (default: none)")
    g.add_argument("-rea", "--reasoning", choices=("on", "off", "auto"), default=None,
                   help="thinking on or off (the chat template's `thinking` variable); auto: the template's default")
    g.add_argument("--reasoning-effort", choices=tuple(EFFORTS), default=None, metavar="LEVEL",
                   help="the template's thinking_effort: low, medium, high or max (minimal and xhigh: low and max, as "
                        "OpenAI names them); none: thinking off (default: the template's, max for K3)")


def reasoning_given(a: argparse.Namespace) -> list[str]:
    """The reasoning flags given on this command line (their names)."""
    return [name for name, attr in REASONING_FLAGS if getattr(a, attr, None) is not None]


def reply_options(a: argparse.Namespace) -> ReplyOptions:
    """The agent flags, checked (UsageError naming the flag); nothing is loaded."""
    budget = -1 if a.reasoning_budget is None else a.reasoning_budget
    if not -1 <= budget <= MAX_BUDGET:
        raise UsageError(f"--reasoning-budget must be -1 (unlimited), 0 or a token count up to {MAX_BUDGET}, "
                         f"got {budget}")
    thinking = None if a.reasoning in (None, "auto") else a.reasoning == "on"
    effort = EFFORTS.get(a.reasoning_effort) if a.reasoning_effort is not None else None
    if a.reasoning_effort is not None:
        wants = a.reasoning_effort != "none"
        if thinking is not None and thinking != wants:
            raise UsageError(f"--reasoning-effort {a.reasoning_effort} and -rea {a.reasoning} disagree: thinking is "
                             f"{'on' if wants else 'off'} with that effort")
        thinking = wants
    return ReplyOptions(a.reasoning_format or "auto", budget, a.reasoning_budget_message or "", thinking, effort,
                        response_constraint(a))


def response_constraint(a: argparse.Namespace) -> Response:
    """-j, -jf, --grammar or --grammar-file as a grammar.Response, validated; None without them
    (or for a parser without add_grammar_arguments)."""
    schema, schema_file = getattr(a, "json_schema", None), getattr(a, "json_schema_file", None)
    grammar, grammar_file = getattr(a, "grammar", None), getattr(a, "grammar_file", None)
    if schema is not None:
        return _schema(_json_text(schema, "-j/--json-schema"), "-j/--json-schema")
    if schema_file is not None:
        where = f"-jf/--json-schema-file {schema_file}"
        return _schema(_reread(lambda: read_json(schema_file, UsageError, "no such file"), where), where)
    if grammar is not None:
        return _gbnf(grammar, "--grammar")
    if grammar_file is not None:
        where = f"--grammar-file {grammar_file}"
        return _gbnf(_reread(lambda: read_text(grammar_file, UsageError, "no such file"), where), where)
    return None


def _reread(read, where: str) -> Any:
    # read_json/read_text name the file; the flag it came from is said too.
    try:
        return read()
    except UsageError as exc:
        raise UsageError(f"{where.split(' ')[0]} {exc}") from None


def _json_text(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not JSON ({exc})") from None
    except RecursionError:
        raise UsageError(f"{where}: JSON nested too deeply") from None


def _schema(value: Any, where: str) -> JsonSchema:
    if not isinstance(value, (dict, bool)):
        raise UsageError(f"{where}: a JSON schema is an object (or true), got {type(value).__name__}")
    if not_unicode(value) is not None:
        raise UsageError(f"{where}: '{not_unicode(value)}' is not valid Unicode (a lone surrogate escape)")
    return _validated(JsonSchema(value), where)


def _gbnf(text: str, where: str) -> Lark:
    if not text.strip():
        raise UsageError(f"{where}: the grammar is empty")
    from llguidance.gbnf_to_lark import any_to_lark  # the grammar engine's own GBNF reader
    try:
        lark = any_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - its converter raises plain exceptions for a bad grammar
        raise UsageError(f"{where}: not a GBNF grammar: {first_error_line(str(exc))}") from None
    return _validated(Lark(lark), where)


def _validated(response: JsonSchema | Lark, where: str) -> JsonSchema | Lark:
    """The grammar engine's own check, before the model loads (no vocabulary needed)."""
    import llguidance
    error = llguidance.LLMatcher.validate_grammar(text_grammar(response))
    if error:
        raise UsageError(f"{where}: {first_error_line(error)}")
    return response


def template_variables(options: ReplyOptions, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The chat template's variables with -rea and --reasoning-effort in them (K3's `thinking`,
    `thinking_effort`; `enable_thinking`, other templates' name, read as `thinking` as the server
    reads it). A --chat-template-kwargs value that says otherwise is refused, not overridden."""
    out = dict(kwargs)
    if "enable_thinking" in out and "thinking" not in out:
        out["thinking"] = bool(out["enable_thinking"])
    given = dict(out)
    for name, value in (("thinking", options.thinking), ("thinking_effort", options.effort)):
        if value is None:
            continue
        if name in given and given[name] != value:
            raise UsageError(f"--chat-template-kwargs sets {name} to {json.dumps(given[name])}, which "
                             f"-rea/--reasoning-effort set to {json.dumps(value)}: give one of them")
        out[name] = value
    return out


def check_agent_options(a: argparse.Namespace) -> None:
    """kimi-k3-cli's agent flags once its mode is known (`a.mode`), before loading: the checked
    options (`a.reply_options`) and, for a chat, the template's variables (`a.template_kwargs`)."""
    a.reply_options = options = reply_options(a)
    if a.mode == "perplexity" and (options.response is not None or reasoning_given(a)):
        raise UsageError("the grammar and reasoning flags apply to generated text, not to --perplexity")
    if options.response is not None and a.ignore_eos:
        raise UsageError("--ignore-eos cannot be used with a grammar or a JSON schema: the constrained text ends "
                         "with the EOS")
    if a.mode == "chat":
        a.template_kwargs = template_variables(options, a.template_kwargs)


def reply_constraint(tokenizer: BPETokenizer, start: str, options: ReplyOptions) -> Constraint | None:
    """One reply's constraint, as the server builds a chat request's: the answer held to the
    grammar (a K3 reply: its response channel; a reply of another template, or a completion
    (`start` text): the whole text), the reasoning budget, and no tools section opened (no tools
    are declared). None when nothing constrains the reply. A plan's matcher is used up by one
    reply, so each reply gets its own."""
    try:
        if start == "text":
            grammar = text_grammar(options.response) if options.response is not None else None
            plan = ConstraintPlan.build(tokenizer, None, grammar=grammar)
        else:
            plan = ConstraintPlan.build(tokenizer, ReplySpec(start, response=options.response),
                                        budget=options.reasoning_budget, budget_message=options.budget_message)
    except GrammarError as exc:  # checked before loading, so only a fault against this vocabulary
        raise UsageError(str(exc)) from None
    return Constraint(plan, tokenizer) if plan is not None else None
