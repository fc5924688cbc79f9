"""One sequence's generation as an iterator of token events: prefill, then sample and evaluate one
token at a time, with llama-cli's stop rules.

    gen = generate(model, prompt_ids, Sampler(params), StopRules(eog={eos}, n_predict=64))
    for event in gen:            # TokenEvent: token, text, logprob, stop
        print(event.text, end="")
    gen.reply                    # tokens, text, reason, the last token not yet evaluated

It is the batch generator (batch.py) with one request, so a completion, every turn of a
conversation and a server's requests share one loop. It never resets the model: the caller decides
what is new (a conversation feeds each turn's new tokens only, the caches keep the rest). A caller
may stop at any token (`stop()`); the caches then hold exactly the tokens evaluated so far, and
`reply.pending` is the sampled token they do not hold yet.
"""
from __future__ import annotations

from typing import Callable, Iterator

from gguf_arch.errors import KimiError

from ..engine.model import Model
from .batch import BatchGenerator, Prompt, prompt_length
from .events import Reply, StopRules, Timings, TokenEvent
from .sampling import Sampler


class GenerationError(KimiError):
    """A prompt the sequence cannot take (exit code 2)."""


def check_fits(model: Model, seq: int, n: int) -> None:
    """GenerationError unless a prompt of n positions fits sequence seq with room for a reply."""
    if not n:
        raise GenerationError("the prompt tokenizes to no tokens")
    if model.seq_pos(seq) + n >= model.n_ctx:
        raise GenerationError(f"the prompt is {model.seq_pos(seq) + n} tokens, the context -c "
                              f"{model.n_ctx}: raise -c or shorten the prompt")


class Generation:
    def __init__(self, model: Model, tokens: Prompt, sampler: Sampler, stop: StopRules, *, seq: int = 0,
                 timings: Timings | None = None, show: Callable[[int], bool] = lambda _t: True,
                 logprobs: int = -1, stop_requested: Callable[[], bool] = lambda: False,
                 constraint: object | None = None):
        """tokens: token ids, or runs of ids and rows (batch.py). stop_requested: asked after each
        model call (a Ctrl-C flag): True ends the generation there, "interrupted", with what was
        fed in the caches and nothing more sampled."""
        check_fits(model, seq, prompt_length(tokens))
        self._batch = BatchGenerator(model, timings=timings)
        self._stop_requested = stop_requested
        self._request = self._batch.add(seq, tokens, sampler, stop, show=show, logprobs=logprobs,
                                        constraint=constraint)

    @property
    def reply(self) -> Reply:
        return self._request.reply

    def __iter__(self) -> Iterator[TokenEvent]:
        while self._batch.active:
            logits = self._batch.feed()
            if self._stop_requested():  # what was fed is in the caches; nothing more is sampled
                break
            for _request, event in self._batch.sample(logits):
                yield event
        if self._batch.active:  # stopped by the flag: the last event, with what the decoder held back
            yield TokenEvent(None, self.stop(), stop="interrupted")

    def stop(self, reason: str = "interrupted") -> str:
        """End the generation before its stop rules do; the text still held back (an incomplete
        UTF-8 sequence's replacement), which the reply's text now ends with."""
        return self._batch.cancel(self._request, reason)


def generate(model: Model, tokens: Prompt, sampler: Sampler, stop: StopRules, **kwargs) -> Generation:
    """Generation's constructor, by the name mlx-lm and llama.cpp use for it."""
    return Generation(model, tokens, sampler, stop, **kwargs)
