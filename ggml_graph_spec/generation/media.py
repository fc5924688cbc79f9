"""Generation from a prompt with images and clips, for the runner and the server alike.

    with VisionEncoder.open("mm.gguf", exact=model.exact) as enc:
        gen = generate_media(model, enc, "<__media__>What is in the picture?", ["a.png"], sampler, stop)
        for event in gen:                 # TokenEvent, as generate's
            print(event.text, end="")

The prompt's `<__media__>` markers become K3's media blocks (vision/prompt.py), the text is
tokenized, each block's one `<|media_pad|>` stands for its item's rows from the vision encoder, and
the sequence is fed as runs of token ids and runs of rows through `generate` (batch.py: one run per
model call); the generated tokens are appended as plain ids, as the reference's cached generation
does. As the reference's merge, a prompt token equal to the model's pad id is fed as a zero row.

A chat (the runner's conversation, the server) renders its messages with the template's own media
placeholder instead (`media_content` parts), tokenizes, and calls `plan_media` on the ids.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from gguf import Keys

from ..engine.model import Model
from ..vision.encode import Media, VisionEncoder
from ..vision.preprocess import MediaItem
from ..vision.prompt import MEDIA_PAD, MergedPrompt, expand_markers, expand_placeholders
from ..vision.weights import check_pairing
from .events import StopRules, Timings
from .generate import Generation, check_fits, generate
from .sampling import Sampler


@dataclass(frozen=True)
class MediaPrompt:
    """A prompt with media, planned: nothing encoded yet."""

    text: str  # the prompt with its media blocks ("" when built from token ids)
    tokens: tuple[int, ...]  # its token ids: one placeholder per item
    items: tuple[MediaItem, ...]
    merged: MergedPrompt  # where each item's rows go

    def __len__(self) -> int:
        """The positions the prompt takes in its sequence."""
        return len(self.merged)


def check_encoder(model: Model, encoder: VisionEncoder) -> None:
    """GGUFError unless the encoder's mmproj is the model's (its rows' width, its placeholder)."""
    check_pairing(encoder.cfg, str(encoder.weights.path), model.cfg.hidden_size,
                  model.tokenizer.special_id(MEDIA_PAD))


def pad_id(model: Model) -> int | None:
    """The token the reference's merge feeds as a zero row: the GGUF's padding token."""
    value = model.weights.metadata.get(Keys.Tokenizer.PAD_ID)
    return None if value is None else int(value)


def plan_media(encoder: VisionEncoder, tokens: Sequence[int], items: Sequence[MediaItem], text: str = ""
               ) -> MediaPrompt:
    """Token ids holding one placeholder per item (PromptError otherwise), planned."""
    merged = expand_placeholders(tokens, encoder.cfg.media_placeholder_id, [encoder.n_rows(i) for i in items])
    return MediaPrompt(text, tuple(int(t) for t in tokens), tuple(items), merged)


def media_prompt(model: Model, encoder: VisionEncoder, text: str, media: Sequence[Media], *,
                 add_bos: bool | None = None) -> MediaPrompt:
    """Prompt text with llama.cpp's `<__media__>` markers (none: the items go in front) and its
    media (paths, PIL images, clips as lists of frames), every file read and checked, nothing
    encoded. add_bos: as BPETokenizer.encode (None: the GGUF's add_bos_token)."""
    check_encoder(model, encoder)
    items = [encoder.media(m) for m in media]
    full = expand_markers(text, items)
    return plan_media(encoder, model.tokenizer.encode(full, add_bos=add_bos), items, full)


def media_runs(model: Model, encoder: VisionEncoder, prompt: MediaPrompt, timings: Timings | None = None
               ) -> list[np.ndarray]:
    """The prompt as the model is fed it: each item encoded, then runs of token ids and rows."""
    if not prompt.items:
        return [np.asarray(prompt.tokens, dtype=np.int64)]
    t = time.perf_counter()
    rows = [encoder.encode(item) for item in prompt.items]
    if timings is not None:
        timings.encode_s += time.perf_counter() - t
        timings.encoded += len(rows)
    return prompt.merged.segments(rows, zero_id=pad_id(model))


def generate_media(model: Model, encoder: VisionEncoder, text: str | MediaPrompt, media: Sequence[Media],
                   sampler: Sampler, stop: StopRules, *, seq: int = 0, add_bos: bool | None = None,
                   timings: Timings | None = None, **kwargs) -> Generation:
    """generate() for a prompt with media: `text` with its markers and `media` (or a MediaPrompt
    already planned, media then empty). The prompt is checked to fit the sequence before anything
    is encoded. kwargs: generate's (show, logprobs, stop_requested)."""
    if isinstance(text, MediaPrompt):
        if media:
            raise ValueError("a planned MediaPrompt holds its media already")
        prompt = text
    else:
        prompt = media_prompt(model, encoder, text, media, add_bos=add_bos)
    check_fits(model, seq, len(prompt))
    return generate(model, media_runs(model, encoder, prompt, timings), sampler, stop, seq=seq, timings=timings,
                    **kwargs)
