"""The server's OpenAPI 3.1 schema, written as data from what the server itself checks: which
fields each endpoint takes from fields.py's tables, every numeric field's range from limits.py,
and the JSON shape of every field's value below (the one place that says it). A refused field is
in the schema only with the values that ask for nothing (fields.py's `off`), so that a valid
request by this schema is one the server serves.

Served at GET /openapi.json; the tests give it to a schema-driven fuzzer (schemathesis).
"""
from __future__ import annotations

from typing import Any

from ..chat.reasoning import EFFORTS, REASONING_FORMATS
from .fields import CHAT, COMPLETIONS, MESSAGES, REFUSED, RESPONSES, Field
from .limits import INT64_MAX, RANGES
from .slot_files import ACTIONS

STRING, BOOL, OBJECT = {"type": "string"}, {"type": "boolean"}, {"type": "object"}
TOKEN = {"type": "integer", "minimum": 0, "maximum": INT64_MAX}


def _obj(required: tuple[str, ...] = (), **properties: Any) -> dict:
    out: dict = {"type": "object", "properties": properties}
    if required:
        out["required"] = list(required)
    return out


def _array(items: dict, max_items: int | None = None, min_items: int = 0) -> dict:
    out: dict = {"type": "array", "items": items}
    if max_items is not None:
        out["maxItems"] = max_items
    if min_items:
        out["minItems"] = min_items
    return out


def _enum(*values: Any) -> dict:
    return {"enum": list(values)}


def _one(*schemas: dict) -> dict:
    return {"anyOf": list(schemas)}


PARAMETERS = {"type": "object"}  # a JSON schema (a tool's parameters, a response format's schema)
TEXT_PART = _obj(("type", "text"), type=_enum("text"), text=STRING)
CHAT_MESSAGE = _obj(("role", "content"), role=_enum("system", "developer", "user", "assistant", "tool"),
                    content=_one(STRING, _array(TEXT_PART)))
FUNCTION = _obj(("name",), name=STRING, description=STRING, parameters=PARAMETERS)
CHAT_TOOL = _obj(("type", "function"), type=_enum("function"), function=FUNCTION)
CHAT_TOOL_CHOICE = _one(_enum("auto", "required", "none"),
                        _obj(("type", "function"), type=_enum("function"), function=_obj(("name",), name=STRING)))
RESPONSE_FORMAT = _one(_obj(("type",), type=_enum("text", "json_object")),
                       _obj(("type", "json_schema"), type=_enum("json_schema"),
                            json_schema=_obj(("schema",), name=STRING, schema=PARAMETERS)))
LOGIT_BIAS = _one({"type": "object", "propertyNames": {"pattern": "^[0-9]{1,6}$"},
                   "additionalProperties": RANGES["logit_bias"].schema()},
                  _array(_array(_one(TOKEN, RANGES["logit_bias"].schema()), 2, 2)))
STOP = _one({"type": "string", "minLength": 1}, _array({"type": "string", "minLength": 1}, 16))

COMMON: dict[str, dict] = {
    "logit_bias": LOGIT_BIAS, "ignore_eos": BOOL, "stop": STOP, "cache_prompt": BOOL, "stream": BOOL,
    "stream_options": _obj(include_usage=BOOL), "model": STRING, "user": STRING, "metadata": OBJECT,
    "service_tier": STRING, "prompt_cache_key": STRING, "safety_identifier": STRING,
    "response_format": RESPONSE_FORMAT, "json_schema": PARAMETERS, "grammar": STRING,
    "messages": _array(CHAT_MESSAGE, min_items=1), "tools": _array(CHAT_TOOL),
    "tool_choice": CHAT_TOOL_CHOICE, "parallel_tool_calls": BOOL, "reasoning_effort": _enum(*EFFORTS),
    "reasoning_format": _enum(*REASONING_FORMATS), "reasoning_budget_message": STRING,
    "chat_template_kwargs": OBJECT,
}
CHAT_VALUES = {"logprobs": BOOL}
COMPLETIONS_VALUES = {"prompt": _one({"type": "string", "minLength": 1}, _array(TOKEN, min_items=1),
                                     _array({"type": "string", "minLength": 1}, 1, 1)),
                      "logprobs": RANGES["logprobs"].schema()}
INPUT_ITEM = _one(_obj(("role", "content"), type=_enum("message"), role=_enum("user", "system", "developer",
                                                                                "assistant"),
                       content=_one(STRING, _array(_obj(("type", "text"), type=_enum("input_text"), text=STRING)))),
                  _obj(("type", "call_id", "output"), type=_enum("function_call_output"), call_id=STRING,
                       output=STRING))
RESPONSES_VALUES = {
    "input": _one(STRING, _array(INPUT_ITEM, min_items=1)), "instructions": STRING,
    "tools": _array(_obj(("type", "name"), type=_enum("function"), name=STRING, description=STRING,
                         parameters=PARAMETERS)),
    "tool_choice": _one(_enum("auto", "required", "none"), _obj(("type", "name"), type=_enum("function"),
                                                                 name=STRING)),
    "text": _obj(format=_one(_obj(("type",), type=_enum("text", "json_object")),
                             _obj(("type", "schema"), type=_enum("json_schema"), name=STRING, schema=PARAMETERS))),
    "reasoning": _obj(effort=_enum(*EFFORTS), summary=STRING), "include": _array(STRING),
    "truncation": _enum("auto", "disabled"), "stream_options": OBJECT, "prompt_cache_retention": STRING,
    "prompt_cache_options": OBJECT,
}
BLOCK = _one(TEXT_PART, _obj(("type", "id", "name", "input"), type=_enum("tool_use"), id=STRING, name=STRING,
                             input=OBJECT),
             _obj(("type", "tool_use_id"), type=_enum("tool_result"), tool_use_id=STRING, content=STRING))
MESSAGES_VALUES = {
    "messages": _array(_obj(("role", "content"), role=_enum("user", "assistant"), content=_one(STRING, _array(BLOCK))),
                       min_items=1),
    "system": _one(STRING, _array(TEXT_PART)),
    "stop_sequences": _array({"type": "string", "minLength": 1}, 16),
    "tools": _array(_obj(("name", "input_schema"), name=STRING, description=STRING, input_schema=PARAMETERS)),
    "tool_choice": _one(_obj(("type",), type=_enum("auto", "any", "none"), disable_parallel_tool_use=BOOL),
                        _obj(("type", "name"), type=_enum("tool"), name=STRING)),
    "thinking": _one(_obj(("type", "budget_tokens"), type=_enum("enabled"),
                          budget_tokens=RANGES["reasoning_budget_tokens"].schema()),
                     _obj(("type",), type=_enum("disabled", "adaptive"))),
    "output_config": _obj(format=_obj(("type", "schema"), type=_enum("json_schema"), schema=PARAMETERS),
                          effort=_enum(*EFFORTS)),
    "cache_control": OBJECT, "speed": STRING, "inference_geo": STRING,
}


def value_schema(f: Field, own: dict[str, dict]) -> dict | None:
    """The schema of one field's value (None: a refused field with no value that asks for nothing)."""
    if f.handling == REFUSED:
        return _enum(*f.off) if f.off else None
    if f.name in own:
        return own[f.name]
    if f.name in RANGES:
        return RANGES[f.name].schema()
    return COMMON[f.name]


def body_schema(table: tuple[Field, ...], own: dict[str, dict] | None = None,
                required: tuple[str, ...] = ()) -> dict:
    """An endpoint's request body: its table's fields and nothing else."""
    own = own or {}
    props = {f.name: s for f in table if (s := value_schema(f, own)) is not None}
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


def _post(schema: dict, summary: str, parameters: list | None = None) -> dict:
    op: dict = {"summary": summary, "requestBody": {"required": True,
                                                    "content": {"application/json": {"schema": schema}}},
                "responses": {"200": {"description": "the reply"}, "4XX": {"description": "an error object"}}}
    if parameters:
        op["parameters"] = parameters
    return {"post": op}


def _get(summary: str) -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": "the reply"}}}}


def document() -> dict:
    """The whole OpenAPI document."""
    chat = body_schema(CHAT, CHAT_VALUES, ("messages",))
    messages = body_schema(MESSAGES, MESSAGES_VALUES, ("messages", "max_tokens"))
    count = {**messages, "required": ["messages"]}
    slot = [{"name": "slot_id", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0}},
            {"name": "action", "in": "query", "required": True, "schema": _enum(*ACTIONS)}]
    paths = {
        "/v1/chat/completions": _post(chat, "OpenAI's chat completion"),
        "/v1/completions": _post(body_schema(COMPLETIONS, COMPLETIONS_VALUES, ("prompt",)), "a text completion"),
        "/v1/responses": _post(body_schema(RESPONSES, RESPONSES_VALUES, ("input",)), "OpenAI's Responses API"),
        "/v1/messages": _post(messages, "Anthropic's Messages API"),
        "/v1/messages/count_tokens": _post(count, "the prompt tokens of a Messages request"),
        "/apply-template": _post(chat, "the prompt a chat request renders to"),
        "/v1/chat/completions/input_tokens": _post(chat, "the prompt tokens of a chat request"),
        "/tokenize": _post(_obj(content=STRING, add_special=BOOL, with_pieces=BOOL), "text to token ids"),
        "/detokenize": _post(_obj(tokens=_array(TOKEN)), "token ids to text"),
        "/slots/{slot_id}": _post(_obj(filename=STRING), "save, restore or erase a slot", slot),
        "/slots": _get("each slot's state"), "/props": _get("the server's properties"),
        "/metrics": _get("Prometheus metrics"), "/health": _get("ok once the model is loaded"),
        "/v1/models": _get("the model"),
    }
    return {"openapi": "3.1.0", "info": {"title": "kimi-k3-server", "version": "1"}, "paths": paths}
