"""A chat request's agent fields: tools, tool_choice, parallel_tool_calls, response_format (and
llama-server's json_schema and grammar), reasoning (reasoning_effort, reasoning_format, the
reasoning budget), and the messages of an agent loop (assistant tool calls, tool results).

What they become: the chat template's variables (the model is told of the tools, the choice, the
format and the effort in K3's own system messages), the reply parser's settings, and the
constraint the engine enforces while the reply is sampled (chat/constraint.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..chat.constraint import ConstraintPlan, GrammarError, first_error_line, grammar_limits
from ..chat.grammar import JsonSchema, Lark, ReplySpec, Response, text_grammar, tools_grammar
from ..chat.reasoning import EFFORTS, MAX_BUDGET, REASONING_FORMATS, reply_start
from ..chat.tools import Tool, ToolChoice, ToolError, parse_tool_choice, parse_tools
from ..text.tokenizer import BPETokenizer
from .errors import bad_request
from .limits import RANGES



@dataclass(frozen=True)
class AgentDefaults:
    """The server's own settings for what a request leaves out (kimi-k3-server's flags)."""

    reasoning_format: str = "auto"
    reasoning_budget: int = -1
    budget_message: str = ""
    thinking: bool | None = None  # --reasoning on/off; None: the template's default
    effort: str | None = None  # --reasoning-effort
    response: Response = None  # -j/-jf/--grammar/--grammar-file: the default of a request that asks none


@dataclass(frozen=True)
class ChatReply:
    """How a chat reply is read and constrained."""

    start: str  # the channel the prompt opened: think, response, or text (not K3's format)
    tools: tuple[Tool, ...] = ()
    choice: ToolChoice = ToolChoice("none")
    reasoning_format: str = "auto"
    plan: ConstraintPlan | None = field(default=None, compare=False)

    @property
    def reasoning_in_content(self) -> bool:
        return self.reasoning_format in ("none", "deepseek-legacy")

    @property
    def reasoning_separate(self) -> bool:
        return self.reasoning_format != "none"


def _err(exc: Exception):
    return bad_request(str(exc))


def response_format(body: Mapping[str, Any]) -> tuple[Response, Any]:
    """The response's constraint and what the template is told (response_format as it reads it)."""
    rf, schema, grammar = body.get("response_format"), body.get("json_schema"), body.get("grammar")
    given = [n for n, v in (("response_format", rf), ("json_schema", schema), ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise bad_request(f"give one of 'response_format', 'json_schema' and 'grammar', not {' and '.join(given)}")
    if grammar is not None:
        return _grammar(grammar), None
    if schema is not None:
        if not isinstance(schema, (dict, bool)):
            raise bad_request("'json_schema' must be a JSON schema object")
        return JsonSchema(schema), {"type": "json_schema", "json_schema": {"schema": schema}}
    if rf is None:
        return None, None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                          "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": ...}}")
    if rf["type"] == "text":
        return None, None
    if rf["type"] == "json_object":
        inner = rf.get("schema")
        return JsonSchema(inner if isinstance(inner, dict) else {"type": "object"}), rf
    wrapper = rf.get("json_schema")
    inner = wrapper.get("schema") if isinstance(wrapper, dict) else None
    if not isinstance(inner, (dict, bool)):
        raise bad_request("'response_format.json_schema.schema' must be a JSON schema object")
    return JsonSchema(inner), rf


def asks_format(body: Mapping[str, Any]) -> bool:
    """Whether the request says what its response is ({"type": "text"} included)."""
    return any(body.get(k) is not None for k in ("response_format", "json_schema", "grammar"))


def _grammar(text: Any) -> Lark:
    """llama-server's `grammar`: GBNF (or llguidance's Lark), for the response channel."""
    if not isinstance(text, str) or not text.strip():
        raise bad_request("'grammar' must be a non-empty GBNF grammar")
    from llguidance.gbnf_to_lark import any_to_lark  # the engine's own GBNF reader
    try:
        return Lark(any_to_lark(text))
    except Exception as exc:  # noqa: BLE001 - its parser raises plain exceptions for a bad grammar
        raise bad_request(f"'grammar' is not a GBNF grammar: {str(exc).splitlines()[0][:200]}") from None


def _reasoning(body: Mapping[str, Any], kwargs: dict, defaults: AgentDefaults) -> None:
    """reasoning_effort (and the server's --reasoning/--reasoning-effort) as template variables;
    the request's own chat_template_kwargs win."""
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in EFFORTS:  # a dict's lookup: an unhashable value raised
            raise bad_request(f"'reasoning_effort' must be one of {', '.join(EFFORTS)}, got {effort!r}")
        kwargs.setdefault("thinking", effort != "none")
        if effort != "none":
            kwargs.setdefault("thinking_effort", EFFORTS[effort])
    if "enable_thinking" in kwargs and "thinking" not in kwargs:  # the name other templates use
        kwargs["thinking"] = bool(kwargs["enable_thinking"])
    if defaults.thinking is not None:
        kwargs.setdefault("thinking", defaults.thinking)
    if defaults.effort is not None:
        kwargs.setdefault("thinking_effort", defaults.effort)


def _budget(body: Mapping[str, Any], defaults: AgentDefaults) -> tuple[int, str]:
    budget = defaults.reasoning_budget
    for name in ("reasoning_budget_tokens", "thinking_budget_tokens"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or not RANGES[name].holds(value):
                raise bad_request(f"'{name}' must be an integer in [-1, {MAX_BUDGET}] (-1: no budget)")
            budget = value
    message = body.get("reasoning_budget_message", defaults.budget_message)
    if not isinstance(message, str):
        raise bad_request("'reasoning_budget_message' must be a string")
    return budget, message


def agent_kwargs(body: Mapping[str, Any], kwargs: dict, defaults: AgentDefaults) -> tuple[list[Tool], ToolChoice,
                                                                                          Response]:
    """Fill the template variables of the agent fields into `kwargs`; the tools, the choice and
    the response's constraint."""
    try:
        tools = parse_tools(body.get("tools"))
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise ToolError("'parallel_tool_calls' must be true or false")
        choice = parse_tool_choice(body.get("tool_choice"), tools, parallel)
    except ToolError as exc:
        raise _err(exc) from None
    response, told = response_format(body)
    if not asks_format(body) and defaults.response is not None:  # the server's -j or --grammar
        response = defaults.response
        told = {"type": "json_schema", "json_schema": {"schema": response.schema}} \
            if isinstance(response, JsonSchema) else None
    if tools:
        kwargs.setdefault("tools", body["tools"])
        kwargs.setdefault("tool_choice", choice.template_value)
    if told is not None:
        kwargs.setdefault("response_format", told)
    _reasoning(body, kwargs, defaults)
    _precheck(tools, choice, response)
    return tools, choice, response


def _precheck(tools: list[Tool], choice: ToolChoice, response: Response) -> None:
    """The response's and the tools' grammars checked before the template renders them: a schema
    that cannot be used is refused for what it is, whatever the size of its rendering."""
    import llguidance
    checks = [("the response format", text_grammar(response))] if response is not None else []
    if choice.allowed(tools):
        checks.append(("the tools' schemas", tools_grammar(tools, choice)))
    for what, grammar in checks:
        error = llguidance.LLMatcher.validate_grammar(grammar, limits=grammar_limits())
        if error:
            raise bad_request(f"{what}: {first_error_line(error)}")


def reply_settings(body: Mapping[str, Any], prompt_text: str, tokenizer: BPETokenizer, tools: list[Tool],
                   choice: ToolChoice, response: Response, defaults: AgentDefaults) -> ChatReply:
    """How the reply to the rendered `prompt_text` is parsed and constrained."""
    start = reply_start(prompt_text)
    fmt = body.get("reasoning_format", defaults.reasoning_format)
    if fmt not in REASONING_FORMATS:
        raise bad_request(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}, got {fmt!r}")
    if start == "text" and (tools or response is not None):
        raise bad_request("tools and response formats need K3's chat format: this server's chat template does not "
                          "open a K3 reply channel")
    budget, message = _budget(body, defaults)
    spec = ReplySpec(start, tuple(tools), choice, response)
    try:
        plan = ConstraintPlan.build(tokenizer, spec, budget=budget, budget_message=message) \
            if start != "text" else None
    except GrammarError as exc:
        raise _err(exc) from None
    return ChatReply(start, tuple(tools), choice, fmt, plan)


def history(messages: list[dict]) -> list[dict]:
    """An agent loop's turns as the template reads them: each assistant tool call's arguments, a
    JSON string in OpenAI's shape, given as the object it spells (K3 writes typed arguments), or
    kept as the string when it is not an object (the template writes it as a json block)."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if m["role"] != "assistant" or not calls:
            out.append(m)
            continue
        if not isinstance(calls, list):
            raise bad_request(f"'messages[{i}].tool_calls' must be a list of tool calls")
        out.append({**m, "tool_calls": [_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]})
    return out


def _call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"'{where}' must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                          "\"arguments\": ...}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except ValueError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else args
    elif not isinstance(args, dict):
        raise bad_request(f"'{where}.function.arguments' must be a JSON string or an object")
    return {**call, "function": {**fn, "arguments": args}}
