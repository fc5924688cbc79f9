"""Every field each endpoint takes, and what it does: honoured, accepted with no effect (and why),
or refused. A field of no table is refused too, by name: nothing a client sends is silently
dropped.

docs/reference/api-fields.md holds these tables as `markdown()` writes them.

A refused field is accepted when it asks for nothing (its value is its off value: `mirostat: 0`,
`n: 1`, `logprobs: false`...), so that a client that always sends a field's default is served.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import bad_request

HONOURED, NO_EFFECT, REFUSED = "honoured", "no effect", "refused"
_ABSENT = object()


@dataclass(frozen=True)
class Field:
    name: str
    handling: str  # HONOURED, NO_EFFECT or REFUSED
    doc: str
    off: tuple = ()  # a refused field's values that ask for nothing (accepted)


def _h(name: str, doc: str) -> Field:
    return Field(name, HONOURED, doc)


def _n(name: str, doc: str) -> Field:
    return Field(name, NO_EFFECT, doc)


def _r(name: str, doc: str, *off: Any) -> Field:
    return Field(name, REFUSED, doc, off)


_SAMPLING = (
    _h("temperature", "sampling temperature; 0 is greedy (default: the server's --temp)"),
    _h("top_p", "nucleus sampling, 1 is off"),
    _h("top_k", "llama-server's top-k, 0 is off"),
    _h("min_p", "llama-server's min-p, 0 is off"),
    _h("seed", "the sampler's seed; -1 or absent: a random one"),
    _h("presence_penalty", "subtracted once from each token of the last repeat_last_n"),
    _h("frequency_penalty", "subtracted per occurrence in the last repeat_last_n"),
    _h("repeat_penalty", "llama-server's repetition penalty, 1 is off"),
    _h("repeat_last_n", "the tokens the penalties look back on"),
    _h("logit_bias", "token id -> bias in [-100, 100] added to its logit (-100: never sampled)"),
    _h("ignore_eos", "never sample the end-of-generation token"),
    _h("stop", "up to 16 strings; the reply ends before the first one (in its content)"),
    _h("cache_prompt", "reuse a slot's cached prefix (default true)"),
    _h("stream", "server-sent events"),
    _h("stream_options", "include_usage: a last chunk with the usage"),
    _h("n", "choices per request: only 1"),
    _r("mirostat", "Mirostat sampling is not implemented", 0),
    _r("mirostat_tau", "Mirostat sampling is not implemented"),
    _r("mirostat_eta", "Mirostat sampling is not implemented"),
    _r("typical_p", "locally typical sampling is not implemented", 1, 1.0),
    _r("top_n_sigma", "top-n-sigma sampling is not implemented", -1, -1.0),
    _r("xtc_probability", "XTC sampling is not implemented", 0, 0.0),
    _r("xtc_threshold", "XTC sampling is not implemented"),
    _r("dry_multiplier", "DRY sampling is not implemented", 0, 0.0),
    _r("dry_base", "DRY sampling is not implemented"),
    _r("dry_allowed_length", "DRY sampling is not implemented"),
    _r("dry_penalty_last_n", "DRY sampling is not implemented"),
    _r("dry_sequence_breakers", "DRY sampling is not implemented"),
    _r("dynatemp_range", "dynamic temperature is not implemented", 0, 0.0),
    _r("dynatemp_exponent", "dynamic temperature is not implemented"),
    _r("min_keep", "not implemented", 0),
    _r("samplers", "the sampler order is llama.cpp's default and fixed"),
    _r("n_probs", "use logprobs / top_logprobs", 0),
    _r("post_sampling_probs", "log-probabilities are the model's, before the samplers", False),
    _r("n_keep", "context shifting is not implemented: a reply ends at the slot's context", 0, -1),
    _r("n_discard", "context shifting is not implemented", 0),
    _r("id_slot", "slots are chosen by the longest cached prefix", -1),
    _r("lora", "LoRA adapters are not supported"),
    _r("t_max_predict_ms", "time limits are not implemented", 0),
    _r("t_max_prompt_ms", "time limits are not implemented", 0),
    _r("return_tokens", "not implemented", False),
    _r("timings_per_token", "timings come with the last chunk", False),
)
_IDENTITY = (
    _n("model", "one model is served; any name is taken"),
    _n("user", "accepted; nothing is logged per user"),
    _n("metadata", "accepted; nothing is stored"),
    _n("service_tier", "one tier"),
    _n("prompt_cache_key", "the prompt cache matches prefixes by itself"),
    _n("safety_identifier", "accepted; nothing is logged per user"),
    _r("store", "nothing is stored for later retrieval", False),
)
_CONSTRAINTS = (
    _h("response_format", "json_object / json_schema enforced by a grammar (docs/server.md)"),
    _h("json_schema", "llama-server's: a JSON schema the reply is held to"),
    _h("grammar", "llama-server's: a GBNF grammar the reply is held to"),
)
CHAT = (
    _h("messages", "system / developer, user, assistant (content, reasoning_content, tool_calls), tool"),
    _h("max_completion_tokens", "the reply's token limit (also max_tokens, n_predict); -1: the context"),
    _h("max_tokens", "as max_completion_tokens"),
    _h("n_predict", "llama-server's name of max_tokens"),
    _h("logprobs", "the sampled token's log-probability"),
    _h("top_logprobs", "up to 20 alternatives per token"),
    _h("tools", "function tools; their calls are held to their parameters' schemas"),
    _h("tool_choice", "auto, required, none, or a named function (honoured)"),
    _h("parallel_tool_calls", "false: at most one call"),
    _h("reasoning_effort", "none (thinking off), minimal/low, medium, high, xhigh/max: K3's thinking_effort"),
    _h("reasoning_format", "auto/deepseek: reasoning_content; deepseek-legacy: both; none: all in content"),
    _h("reasoning_budget_tokens", "think tokens before the channel is closed (-1: no budget, 0: none)"),
    _h("thinking_budget_tokens", "as reasoning_budget_tokens"),
    _h("reasoning_budget_message", "text written before the forced end of the think channel"),
    _h("chat_template_kwargs", "extra chat template variables (thinking, thinking_effort, ...)"),
    *_CONSTRAINTS, *_SAMPLING, *_IDENTITY,
    _r("functions", "deprecated by OpenAI: use tools"),
    _r("function_call", "deprecated by OpenAI: use tool_choice"),
    _r("audio", "text only"),
    _r("modalities", "text only", ["text"]),
    _r("prediction", "predicted outputs are not implemented"),
    _r("web_search_options", "this server searches nothing"),
    _r("verbosity", "K3 has no verbosity setting; use reasoning_effort or the prompt"),
)
COMPLETIONS = (
    _h("prompt", "a string, token ids, or a list of one of them"),
    _h("max_tokens", "the completion's token limit (also n_predict); -1: the context"),
    _h("n_predict", "llama-server's name of max_tokens"),
    _h("logprobs", "the top N alternatives per token (0-20)"),
    *_CONSTRAINTS, *_SAMPLING, *_IDENTITY,
    _r("echo", "the prompt is not repeated in the reply", False),
    _r("best_of", "one completion per request", 1),
    _r("suffix", "fill-in-the-middle is not supported"),
)
# llama-server's and this server's extensions that the Responses and Messages APIs pass on to the
# chat completion they become (agent SDKs send them as extra_body).
PASSED_ON = ("seed", "top_k", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty",
             "logit_bias", "ignore_eos", "cache_prompt", "chat_template_kwargs", "reasoning_format",
             "reasoning_budget_tokens", "thinking_budget_tokens", "reasoning_budget_message")
_EXTENSIONS = tuple(f for f in CHAT if f.name in PASSED_ON)
RESPONSES = (
    _h("input", "a string, or message / function_call / function_call_output / reasoning items"),
    _h("instructions", "the system message"),
    _h("tools", "function tools (the caller runs them); other tool types are refused"),
    _h("tool_choice", "auto, required, none, or {\"type\": \"function\", \"name\": ...}"),
    _h("parallel_tool_calls", "false: at most one call"),
    _h("max_output_tokens", "the reply's token limit; reaching it: status incomplete"),
    _h("temperature", "as in chat completions"),
    _h("top_p", "as in chat completions"),
    _h("top_logprobs", "log-probabilities of the output text"),
    _h("stream", "the Responses API's named events"),
    _h("text", "format: text, json_object or json_schema (enforced)"),
    _h("reasoning", "effort: K3's thinking_effort (none: thinking off); summary: no effect"),
    _n("include", "the output always has what this server can give (no encrypted reasoning)"),
    _n("truncation", "a prompt past the context is refused whatever it says"),
    _n("stream_options", "no options apply"),
    _n("prompt_cache_retention", "the prompt cache keeps what its slots hold"),
    _n("prompt_cache_options", "the prompt cache matches prefixes by itself"),
    *_EXTENSIONS, *_IDENTITY,
    _r("previous_response_id", "nothing is stored: send the whole input"),
    _r("conversation", "nothing is stored: send the whole input"),
    _r("background", "replies are not run in the background", False),
    _r("prompt", "no stored prompts"),
    _r("max_tool_calls", "not implemented; use parallel_tool_calls"),
    _r("context_management", "no server-side compaction"),
)
MESSAGES = (
    _h("messages", "user and assistant turns: text, image (base64), tool_use, tool_result, thinking blocks"),
    _h("system", "a string or text blocks"),
    _h("max_tokens", "the reply's token limit (required)"),
    _h("stop_sequences", "the reply ends before the first one; stop_reason stop_sequence"),
    _h("stream", "Anthropic's streaming events"),
    _h("temperature", "as in chat completions"),
    _h("top_p", "as in chat completions"),
    _h("top_k", "as in chat completions"),
    _h("tools", "custom tools (input_schema); server tools are refused"),
    _h("tool_choice", "auto, any (required), tool (named), none; disable_parallel_tool_use"),
    _h("thinking", "enabled (budget_tokens: the reasoning budget), disabled (thinking off), adaptive"),
    _h("output_config", "format: a json_schema the reply is held to; effort: K3's thinking_effort"),
    *(f for f in _EXTENSIONS if f.name != "top_k"),
    _n("model", "one model is served; any name is taken"),
    _n("metadata", "accepted; nothing is stored"),
    _n("service_tier", "one tier"),
    _n("cache_control", "the prompt cache matches prefixes by itself"),
    _n("speed", "one speed"),
    _n("inference_geo", "this machine"),
    _r("container", "no code execution containers"),
    _r("mcp_servers", "this server connects to nothing"),
    _r("context_management", "no server-side compaction"),
    _r("diagnostics", "not implemented"),
)


def check_fields(body: Mapping[str, Any], table: tuple[Field, ...], endpoint: str) -> None:
    """400 naming the first field the endpoint does not take: unknown, or refused (unless off)."""
    known = {f.name: f for f in table}
    for name, value in body.items():
        f = known.get(name)
        if f is None:
            raise bad_request(f"'{name}' is not a field of {endpoint} (docs/server.md lists every field)")
        if f.handling == REFUSED and value is not None and not _is_off(value, f.off):
            raise bad_request(f"'{name}' is not supported by this server: {f.doc}")


def _is_off(value: Any, off: tuple) -> bool:
    return any(value == o and type(value) is type(o) for o in off)


ENDPOINTS = (("POST /v1/chat/completions", CHAT), ("POST /v1/completions", COMPLETIONS),
             ("POST /v1/responses", RESPONSES), ("POST /v1/messages", MESSAGES))


def markdown() -> str:
    """Every endpoint's fields as markdown tables (the reference page's body)."""
    out = []
    for title, table in ENDPOINTS:
        out += [f"## {title}", "", "| field | | what it does |", "|---|---|---|"]
        for f in table:
            off = f" (accepted when {', '.join(f'`{json.dumps(o)}`' for o in f.off)})" if f.off else ""
            out.append(f"| `{f.name}` | {f.handling} | {f.doc.replace('|', '/')}{off} |")
        out.append("")
    return "\n".join(out)
