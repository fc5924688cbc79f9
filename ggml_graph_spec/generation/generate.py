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

from typing import Callable, Iterator, Sequence

from gguf_arch.errors import KimiError

from ..engine.model import Model
from .batch import BatchGenerator
from .events import Reply, StopRules, Timings, TokenEvent
from .sampling import Sampler


class GenerationError(KimiError):
    """A prompt the sequence cannot take (exit code 2)."""


class Generation:
    def __init__(self, model: Model, tokens: Sequence[int], sampler: Sampler, stop: StopRules, *, seq: int = 0,
                 timings: Timings | None = None, show: Callable[[int], bool] = lambda _t: True,
                 logprobs: int = -1, stop_requested: Callable[[], bool] = lambda: False):
        """stop_requested: asked after each model call (a Ctrl-C flag): True ends the generation
        there, "interrupted", with what was fed in the caches and nothing more sampled."""
        if not tokens:
            raise GenerationError("the prompt tokenizes to no tokens")
        if model.seq_pos(seq) + len(tokens) >= model.n_ctx:
            raise GenerationError(f"the prompt is {model.seq_pos(seq) + len(tokens)} tokens, the context -c "
                                  f"{model.n_ctx}: raise -c or shorten the prompt")
        self._batch = BatchGenerator(model, timings=timings)
        self._stop_requested = stop_requested
        self._request = self._batch.add(seq, list(tokens), sampler, stop, show=show, logprobs=logprobs)

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


def generate(model: Model, tokens: Sequence[int], sampler: Sampler, stop: StopRules, **kwargs) -> Generation:
    """Generation's constructor, by the name mlx-lm and llama.cpp use for it."""
    return Generation(model, tokens, sampler, stop, **kwargs)
