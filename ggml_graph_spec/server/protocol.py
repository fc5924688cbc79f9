"""A request body, checked and turned into what the engine runs: OpenAI's fields, llama-server's
extensions (`top_k`, `min_p`, `repeat_penalty`, `repeat_last_n`, `ignore_eos`, `cache_prompt`,
`n_predict`), each with its type and range; anything else is one 400 naming the field.

A field left out takes the server's default (`RequestDefaults`: kimi-k3-server's -n, --temp, ...
flags, llama-server's way), which without those flags is what `kimi-k3-cli` does without its
flag. A field the endpoint does not take is refused by name (fields.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from gguf_arch.errors import KimiError

from ..chat.constraint import ConstraintPlan, GrammarError
from ..chat.grammar import text_grammar
from ..generation.sampling import SamplingParams
from ..text.chat_template import (RESERVED_KWARGS, ChatTemplate, encode_marked, has_marks, mark_input,
                                  reserved_kwargs)
from ..text.tokenizer import BPETokenizer
from ..vision.preprocess import MediaItem
from .errors import bad_request
from .fields import CHAT, COMPLETIONS, check_fields
from .limits import ALL_TOKENS, MAX_BIAS, integer, number, window  # noqa: F401  (ALL_TOKENS: cli.py reads it here)
from .agent import AgentDefaults, ChatReply, asks_format, response_format, agent_kwargs, history, reply_settings
from .media import Vision, image_parts

MAX_STOP_STRINGS = 16
ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer name for system
_UNSET = object()


@dataclass(frozen=True)
class RequestDefaults:
    """What a request that leaves a field out gets (the server's flags; seed None: a random one)."""

    sampling: SamplingParams = SamplingParams()
    max_tokens: int = -1
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenRequest:
    """One generation, as the engine runs it."""

    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int  # -1: until the end-of-generation token or a full context
    stop: tuple[str, ...]
    logprobs: int  # -1: none; else the alternatives per token (0: the sampled token's only)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    chat: bool  # a chat reply: special tokens and the template's tag markup are not text
    cache_prompt: bool  # may reuse a slot's cached prefix (llama-server's cache_prompt)
    ignore_eos: bool
    runs: list | None = None  # a prompt with images: runs of ids and rows (prompt then has -1 at the rows)
    reply: ChatReply | None = None  # a chat reply's channels, tools and constraint (agent.py)
    plan: ConstraintPlan | None = None  # a completion's grammar


def get_field(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], what: str, default: Any = _UNSET) -> Any:
    """body[name] when it is of `kinds` (never a bool for a number), else 400 naming the field."""
    value = body.get(name, _UNSET)
    if value is _UNSET or value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise bad_request(f"'{name}' must be {what}, got a boolean")
    if not isinstance(value, kinds):
        raise bad_request(f"'{name}' must be {what}, got {type(value).__name__} {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    """A number field in its range (limits.py); absent: `default`, taken as it is."""
    value = get_field(body, name, (int, float), "a number", _UNSET)
    return default if value is _UNSET else number(name, value)


def _integer(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    """An integer field in its range (limits.py); absent: `default`, taken as it is. An integral
    number written as a float (4.0) is that integer, as JSON Schema and OpenAI's API read it."""
    value = get_field(body, name, (int, float), "an integer", _UNSET)
    if isinstance(value, float):
        if not value.is_integer():
            raise bad_request(f"'{name}' must be an integer, got float {_show(value)}")
        value = int(value)
    return default if value is _UNSET else integer(name, value)


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    return get_field(body, name, (bool,), "true or false", default)


def logit_bias(body: Mapping[str, Any], vocab: int) -> tuple[frozenset[int], tuple[tuple[int, float], ...]]:
    """OpenAI's logit_bias ({"token id": bias}) or llama-server's [[id, bias], ...]: the tokens
    never sampled (bias -100, or false) and the biases added to the others' logits."""
    value = body.get("logit_bias")
    if value is None:
        return frozenset(), ()
    pairs = list(value.items()) if isinstance(value, dict) else value if isinstance(value, list) else None
    if pairs is None or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise bad_request("'logit_bias' must map token ids to biases: {\"123\": -100}")
    banned, biases = set(), []
    for key, bias in pairs:
        # ASCII digits only, and few: str.isdigit also takes "²", which int() does not
        tid = int(key) if isinstance(key, int) else int(key) if isinstance(key, str) and _ID.fullmatch(key) else None
        if tid is None or isinstance(key, bool) or not 0 <= tid < vocab:
            raise bad_request(f"'logit_bias': {key!r} is not a token id of the vocabulary 0..{vocab - 1}")
        if bias is False or (isinstance(bias, (int, float)) and not isinstance(bias, bool) and bias == -MAX_BIAS):
            banned.add(tid)
        elif isinstance(bias, (int, float)) and not isinstance(bias, bool) and -MAX_BIAS < bias <= MAX_BIAS:
            biases.append((tid, float(bias)))
        else:
            raise bad_request(f"'logit_bias[{key}]' must be a number in [-100, 100], got {_show(bias)}")
    if len(banned) >= vocab:
        raise bad_request("'logit_bias' bans every token of the vocabulary: nothing could be sampled")
    return frozenset(banned), tuple(biases)


_ID = re.compile(r"[0-9]{1,19}")


def sampling_params(body: Mapping[str, Any], suppress: frozenset[int],
                    base: SamplingParams = SamplingParams(), vocab: int = 1 << 31) -> SamplingParams:
    """temperature, top_p, top_k, min_p, seed, repeat_penalty / repeat_last_n, presence_penalty,
    frequency_penalty: llama-server's names and meanings (temperature <= 0 is greedy; -1 seed:
    random); a field left out is `base`'s (the server's defaults)."""
    seed = _integer(body, "seed", None)
    banned, biases = logit_bias(body, vocab)
    if len(suppress | banned) >= vocab:
        raise bad_request("'logit_bias' with 'ignore_eos' leaves no token that could be sampled")
    return SamplingParams(
        temp=_number(body, "temperature", base.temp),
        top_k=_integer(body, "top_k", base.top_k),
        top_p=_number(body, "top_p", base.top_p),
        min_p=_number(body, "min_p", base.min_p),
        seed=base.seed if seed is None else None if seed == -1 else seed,
        repeat_penalty=_number(body, "repeat_penalty", base.repeat_penalty),
        repeat_last_n=window(_integer(body, "repeat_last_n", base.repeat_last_n)),
        presence_penalty=_number(body, "presence_penalty", base.presence_penalty),
        frequency_penalty=_number(body, "frequency_penalty", base.frequency_penalty),
        suppress=suppress | banned, bias=biases)


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = get_field(body, "stop", (str, list), "a string or a list of strings", [])
    stops = [value] if isinstance(value, str) else value
    if len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stops):
        raise bad_request(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    return tuple(stops)


def _max_tokens(body: Mapping[str, Any], default: int = -1) -> int:
    """max_completion_tokens, max_tokens or llama-server's n_predict (absent: `default`, the server's
    -n); -1: no limit but the context. Any size is taken: the slot's context clamps it
    (finish_reason "length")."""
    for name in ("max_completion_tokens", "max_tokens", "n_predict"):
        value = _integer(body, name, None)  # 0 is refused by its range
        if value is not None:
            return value
    return default


def _logprobs(body: Mapping[str, Any], chat: bool) -> int:
    """Chat: logprobs true/false and top_logprobs N; completions: logprobs N (OpenAI's shapes)."""
    if chat:
        top = _integer(body, "top_logprobs", None)
        if not _flag(body, "logprobs", False):
            if top is not None:
                raise bad_request("'top_logprobs' needs 'logprobs': true")
            return -1
        return top or 0
    n = _integer(body, "logprobs", None)
    return -1 if n is None else n


def _n(body: Mapping[str, Any]) -> None:
    n = get_field(body, "n", (int,), "an integer", 1)
    if n != 1:
        raise bad_request(f"'n' must be 1: this server returns one choice per request, got {_show(n)}")


def gen_request(body: Any, prompt: list[int], chat: bool, eos: int | None,
                defaults: RequestDefaults = RequestDefaults(), vocab: int = 1 << 31) -> GenRequest:
    """The generation a checked body asks for, on already tokenized `prompt`."""
    check_fields(body, CHAT if chat else COMPLETIONS, "/v1/chat/completions" if chat else "/v1/completions")
    _n(body)
    ignore_eos = _flag(body, "ignore_eos", defaults.ignore_eos)
    options = get_field(body, "stream_options", (dict,), "an object", {})
    return GenRequest(
        prompt=prompt,
        sampling=sampling_params(body, frozenset({eos}) if ignore_eos and eos is not None else frozenset(),
                                 defaults.sampling, vocab),
        max_tokens=_max_tokens(body, defaults.max_tokens), stop=_stops(body), logprobs=_logprobs(body, chat),
        stream=_flag(body, "stream", False), include_usage=_flag(options, "include_usage", False),
        chat=chat, cache_prompt=_flag(body, "cache_prompt", True), ignore_eos=ignore_eos)


def check_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# ---- prompts -----------------------------------------------------------------------------------

def token_ids(value: Any, name: str, vocab: int) -> list[int]:
    """A list of token ids, each in the vocabulary."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(f"'{name}' must be a list of token ids (integers)")
    bad = next((t for t in value if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"'{name}': token id {bad} is outside the vocabulary 0..{vocab - 1}")
    return list(value)


def completion_prompt(body: Mapping[str, Any], tokenizer: BPETokenizer) -> list[int]:
    """/v1/completions' prompt: a string, token ids, or a list holding one of them (n=1 only)."""
    prompt = body.get("prompt", _UNSET)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # OpenAI's batch form with one prompt
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = token_ids(prompt, "prompt", tokenizer.vocab_size)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("'prompt' holds several prompts: this server takes one per request")
    elif isinstance(prompt, list):
        raise bad_request("'prompt' must be a string or a list of token ids (integers)")
    else:
        raise bad_request("'prompt' is required: a string or a list of token ids")
    if not ids:
        raise bad_request("'prompt' is empty: it tokenizes to no tokens")
    return ids


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise bad_request(f"'messages[{i}]' must be an object with 'role' and 'content'")
    role = m.get("role")
    if role not in ROLES:
        raise bad_request(f"'messages[{i}].role' must be one of {', '.join(ROLES)}, got {_show(role)}")
    content = m.get("content")
    if role == "tool" and not isinstance(content, (str, list)):
        raise bad_request(f"'messages[{i}].content' is required for the tool role: the tool's result")
    if content is None and role != "assistant":
        raise bad_request(f"'messages[{i}].content' is required for the {role} role")
    if content is not None and not isinstance(content, (str, list)):
        raise bad_request(f"'messages[{i}].content' must be a string or a list of content parts")
    if isinstance(content, list) and not all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content):
        raise bad_request(f"'messages[{i}].content' parts must be objects with a 'type'")
    out = {**m, "role": "system" if role == "developer" else role}
    return out


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    items: list[MediaItem]
    reply: ChatReply
    text: str  # the rendering, input marks included (text/chat_template.py)


def chat_prompt(body: Mapping[str, Any], template: ChatTemplate, tokenizer: BPETokenizer,
                vision: Vision | None = None, defaults: AgentDefaults = AgentDefaults()) -> ChatPrompt:
    """/v1/chat/completions' messages rendered with the chat template (the request's
    chat_template_kwargs and agent fields as its variables, every string of the request marked as
    input), tokenized; the images of its image_url parts, in order (server/media.py); how the
    reply is parsed and constrained (agent.py)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required: a non-empty list of messages")
    checked, items = image_parts([_message(m, i) for i, m in enumerate(messages)], vision)
    kwargs = dict(get_field(body, "chat_template_kwargs", (dict,), "an object", {}))
    reserved = reserved_kwargs(kwargs)
    if reserved:
        raise bad_request(f"'chat_template_kwargs' may not set {', '.join(map(repr, reserved))} (reserved: "
                          f"{', '.join(RESERVED_KWARGS)})")
    tools, choice, response = agent_kwargs(body, kwargs, defaults)
    if has_marks(checked) or has_marks(kwargs):
        raise bad_request("the request holds U+10FFFE or U+10FFFF, noncharacters this server reserves for its own use")
    marked, marked_kwargs = mark_input(history(checked), tokenizer), mark_input(kwargs, tokenizer)
    text = _render(lambda: template.render(marked, add_generation_prompt=True, **marked_kwargs))
    reply = reply_settings(body, text, tokenizer, tools, choice, response, defaults)
    return ChatPrompt(encode_marked(text, tokenizer), items, reply, text)


def completion_plan(body: Mapping[str, Any], tokenizer: BPETokenizer,
                    defaults: AgentDefaults = AgentDefaults()) -> ConstraintPlan | None:
    """/v1/completions' json_schema, grammar or response_format (else the server's -j or
    --grammar): the whole text is constrained."""
    response, _told = response_format(body)
    response = defaults.response if not asks_format(body) else response
    if response is None:
        return None
    try:
        return ConstraintPlan.build(tokenizer, None, grammar=text_grammar(response))
    except GrammarError as exc:
        raise bad_request(str(exc)) from None


def _render(render: Callable[[], str]) -> str:
    try:
        return render()
    except KimiError as exc:  # the template's own refusal (an image part, a tool call, raise_exception)
        raise bad_request(str(exc)) from None
