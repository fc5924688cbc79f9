"""Tool declarations as OpenAI sends them, checked once, and what the reply parser and the grammars
need of each: its name and its parameters' JSON schema.

    [{"type": "function", "function": {"name": "get_weather", "description": "...",
                                       "parameters": {"type": "object", "properties": {...}}}}]

An argument's value is taken raw when the tool's schema says the property is a string (as K3 writes
strings: unquoted), and as JSON otherwise; a property the schema does not name follows the
model's own `type="..."` attribute (llama.cpp's rule, common/parsers/kimi-k3.cpp).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

MAX_TOOLS = 512
MAX_NAME = 256


class ToolError(ValueError):
    """A declaration or a choice that cannot be used; the message names the field."""


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: Mapping[str, Any] = field(default_factory=dict)  # a JSON schema; {} takes anything

    def properties(self) -> Mapping[str, Any]:
        props = self.parameters.get("properties")
        return props if isinstance(props, dict) else {}

    def required(self) -> list[str]:
        req = self.parameters.get("required")
        return [r for r in req if isinstance(r, str)] if isinstance(req, list) else []

    def raw_string(self, key: str, written_type: str | None) -> bool:
        """Whether argument `key`'s value is raw text (a string) rather than JSON."""
        schema = self.properties().get(key)
        if isinstance(schema, dict) and "type" in schema:
            return schema["type"] == "string"
        return written_type in (None, "string")


def _schema(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ToolError(f"'{where}' must be a JSON schema object")
    if value.get("type", "object") != "object":
        raise ToolError(f"'{where}' must be an object schema (type \"object\"), got type {value.get('type')!r}")
    props = value.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        raise ToolError(f"'{where}.properties' must map names to schemas")
    return value


def _tool(item: Any, where: str) -> Tool:
    if not isinstance(item, dict) or item.get("type", "function") != "function":
        raise ToolError(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}")
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"'{where}.function' must be an object with a 'name'")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME:
        raise ToolError(f"'{where}.function.name' must be a non-empty string of at most {MAX_NAME} characters")
    return Tool(name, _schema(fn.get("parameters"), f"{where}.function.parameters"))


def parse_tools(value: Any, where: str = "tools") -> list[Tool]:
    """The declared tools (OpenAI's `tools`), each name once."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ToolError(f"'{where}' must be a list of tools")
    if len(value) > MAX_TOOLS:
        raise ToolError(f"'{where}' declares {len(value)} tools; this server takes at most {MAX_TOOLS}")
    tools = [_tool(t, f"{where}[{i}]") for i, t in enumerate(value)]
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ToolError(f"'{where}' declares the tool {dup!r} twice")
    return tools


@dataclass(frozen=True)
class ToolChoice:
    """What the reply may do with the tools: auto (free, calls valid when made), required (at
    least one call), none (no call), or one named tool (required, that one only)."""

    mode: str  # auto | required | none | named
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: more than one call in the reply

    def allowed(self, tools: Sequence[Tool]) -> list[Tool]:
        if self.mode == "none":
            return []
        return [t for t in tools if self.name is None or t.name == self.name]

    @property
    def template_value(self) -> str | None:
        """The `tool_choice` the chat template is given: a named tool is required of it."""
        return "required" if self.mode == "named" else self.mode


def parse_tool_choice(value: Any, tools: Sequence[Tool], parallel: bool = True,
                      where: str = "tool_choice") -> ToolChoice:
    """OpenAI's tool_choice: "auto", "required", "none" or {"type": "function", "function":
    {"name": ...}}; without tools only "none" or "auto" make sense."""
    if value is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel)
    if isinstance(value, str):
        if value not in ("auto", "required", "none"):
            raise ToolError(f"'{where}' must be \"auto\", \"required\", \"none\" or a named function, got {value!r}")
        if value == "required" and not tools:
            raise ToolError(f"'{where}' is \"required\" but the request declares no tools")
        return ToolChoice(value if tools else "none", parallel=parallel)
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError(f"'{where}' must be a string or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    if name not in {t.name for t in tools}:
        raise ToolError(f"'{where}' names the tool {name!r}, which 'tools' does not declare")
    return ToolChoice("named", name, parallel)


def dumps(value: Any) -> str:
    """JSON as the arguments of a tool call are written: compact, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
