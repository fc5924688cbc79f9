"""What generation yields and reports: token events, stop rules, the reply so far, timings."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, the text it completes (may be empty: part of a UTF-8 sequence,
    a hidden token), its log-probability and the most likely alternatives when asked for (the
    model's distribution, before any sampling filter), and why generation stopped on it (None
    while it goes on). token None: no new token, the generation was stopped by its caller; text
    is what the decoder still held back."""

    token: int | None
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    stop: str | None = None


@dataclass
class Timings:
    load_s: float = 0.0
    prompt_s: float = 0.0
    prompt_tokens: int = 0
    eval_s: float = 0.0
    eval_runs: int = 0
    sample_s: float = 0.0
    samples: int = 0
    encode_s: float = 0.0  # images and clips through the vision encoder
    encoded: int = 0

    def lines(self) -> list[str]:
        total = self.load_s + self.encode_s + self.prompt_s + self.eval_s + self.sample_s
        sampling = [f"{'sampling time':>17} = {self.sample_s * 1e3:10.2f} ms / {self.samples:5d} runs   "
                    f"{_rate(self.sample_s, self.samples)}"] if self.samples else []
        encoding = [f"{'media encode time':>17} = {self.encode_s * 1e3:10.2f} ms / {self.encoded:5d} items"
                    ] if self.encoded else []
        return [
            f"{'load time':>17} = {self.load_s * 1e3:10.2f} ms",
            *encoding,
            *sampling,
            f"{'prompt eval time':>17} = {self.prompt_s * 1e3:10.2f} ms / {self.prompt_tokens:5d} tokens "
            f"{_rate(self.prompt_s, self.prompt_tokens)}",
            f"{'eval time':>17} = {self.eval_s * 1e3:10.2f} ms / {self.eval_runs:5d} runs   "
            f"{_rate(self.eval_s, self.eval_runs)}",
            f"{'total time':>17} = {total * 1e3:10.2f} ms / {self.prompt_tokens + self.eval_runs:5d} tokens",
        ]


def _rate(seconds: float, n: int) -> str:
    if n == 0 or seconds <= 0:
        return "(    n/a ms per token,      n/a tokens per second)"
    return f"({seconds * 1e3 / n:8.2f} ms per token, {n / seconds:8.2f} tokens per second)"


@dataclass(frozen=True)
class StopRules:
    eog: frozenset[int]  # tokens that end generation (the EOS); not printed
    n_predict: int = -1  # < 0: no limit
    reverse_prompts: tuple[str, ...] = ()  # stop once the output shows one of them


@dataclass
class Reply:
    tokens: list[int] = field(default_factory=list)  # every sampled token, the last one included
    text: str = ""  # what was printed
    reason: str = ""  # eog, n_predict, context, reverse prompt, interrupted, cancelled
    pending: int | None = None  # the last sampled token: not yet evaluated, so not in the caches


def stop_reason(text: str, piece_len: int, n_tokens: int, stop: StopRules, context_full: bool) -> str:
    """Why generation stops after a token that made the reply `text` (its last piece_len
    characters new) and `n_tokens` long; "" to go on."""
    window = text[-(max(map(len, stop.reverse_prompts), default=0) + piece_len):]
    if any(p in window for p in stop.reverse_prompts):
        return "reverse prompt"
    if n_tokens == stop.n_predict:
        return "n_predict"
    return "context" if context_full else ""
