"""Prompts with media: the marker becomes K3's media block, the block's one placeholder token the
media item's embedding rows. Pure functions, for the runner and the server alike.

1. Text: each `<__media__>` (llama.cpp's marker) becomes the block Moonshot's processor writes,
   `<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>` with the image's
   original width and height (a clip: `<|media_begin|>video<|media_content|>...`), items in
   order. A prompt without any marker gets one per item in front, as llama-mtmd-cli does;
   otherwise the counts must agree.
2. Tokens: the tokenized prompt holds exactly one `<|media_pad|>` per item; each is replaced in
   place by that item's N rows (`expand_placeholders`), so the merged length is
   S - items + sum(N). `merge_embeddings` builds the text model's input rows: token embeddings,
   the items' rows at their places, and, as the reference's merge does, a zero row for every
   prompt token equal to the pad id. (Generated tokens are appended as plain embeddings: the
   engine's business, not this module's.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from gguf_arch.errors import KimiError

from .preprocess import MediaItem

MEDIA_MARKER = "<__media__>"
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>",
                                                    "<|media_end|>")


class PromptError(KimiError):
    """The prompt's media markers or placeholders do not match the media given."""


def media_block(item: MediaItem) -> str:
    """K3's media block for one item, as Moonshot's processor writes it."""
    what = "video" if item.is_video else f"image {item.size[0]}x{item.size[1]}"
    return f"{MEDIA_BEGIN}{what}{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}"


def _texts(text: str, n_items: int, marker: str) -> list[str]:
    """The text around the markers: n_items + 1 pieces (no marker at all: the items go in front)."""
    parts = text.split(marker)
    if len(parts) == 1 and n_items:
        parts = [""] * n_items + [text]
    if len(parts) - 1 != n_items:
        raise PromptError(f"the prompt has {len(parts) - 1} media marker(s) {marker} for {n_items} media item(s); "
                          "give one marker per image or clip, in order")
    return parts


def expand_markers(text: str, items: Sequence[MediaItem], marker: str = MEDIA_MARKER) -> str:
    """The prompt text with each marker replaced by its item's media block."""
    parts = _texts(text, len(items), marker)
    return parts[0] + "".join(media_block(item) + rest for item, rest in zip(items, parts[1:]))


def media_part(item: MediaItem) -> dict:
    """An item as a chat message's content part, for a chat template to render with its own media
    placeholder: {"type": "image", "width", "height"} (the original size, as the media block
    names it), or {"type": "video", "frames", "width", "height"}."""
    width, height = item.size
    if item.is_video:
        return {"type": "video", "frames": item.grid[0], "width": width, "height": height}
    return {"type": "image", "width": width, "height": height}


def media_content(text: str, items: Sequence[MediaItem], marker: str = MEDIA_MARKER) -> list[dict]:
    """A user message's content as parts in order: the text around the markers ({"type": "text"},
    empty pieces left out) and each item's part (media_part), under the markers' rule."""
    parts = _texts(text, len(items), marker)
    out = [{"type": "text", "text": parts[0]}]
    for item, rest in zip(items, parts[1:]):
        out += [media_part(item), {"type": "text", "text": rest}]
    return [p for p in out if p["type"] != "text" or p["text"]]


@dataclass(frozen=True)
class MergedPrompt:
    """The text model's input sequence: a token id per position, -1 where an item's rows go."""

    token_ids: np.ndarray  # int64 [M]
    media_starts: tuple[int, ...]  # each item's first position
    media_counts: tuple[int, ...]  # each item's rows

    def __len__(self) -> int:
        return len(self.token_ids)

    def segments(self, rows: Sequence[np.ndarray], zero_id: int | None = None) -> list[np.ndarray]:
        """The sequence as the engine takes it, in order: runs of token ids (int64) and runs of
        float32 rows (an item's, or a zero row for each token equal to `zero_id`, as
        `merge_embeddings` makes them)."""
        width = rows[0].shape[1] if rows else 0
        where = {start: r for start, r in zip(self.media_starts, rows)}
        out, pos, ids = [], 0, self.token_ids
        while pos < len(ids):
            if pos in where:
                out.append(np.asarray(where[pos], dtype=np.float32))
                pos += len(where[pos])
                continue
            end = pos
            while end < len(ids) and ids[end] >= 0 and end not in where and (zero_id is None or ids[end] != zero_id):
                end += 1
            if end == pos:  # a token the reference's merge zeroes
                out.append(np.zeros((1, width), dtype=np.float32))
                end += 1
            else:
                out.append(ids[pos:end])
            pos = end
        return out


def expand_placeholders(ids: Sequence[int], pad_id: int, counts: Sequence[int]) -> MergedPrompt:
    """Each of the prompt's placeholder tokens replaced by its item's `counts[i]` rows, in order."""
    ids = np.asarray(ids, dtype=np.int64)
    where = np.flatnonzero(ids == pad_id)
    if len(where) != len(counts):
        raise PromptError(f"the tokenized prompt has {len(where)} media placeholder token(s) (id {pad_id}) for "
                          f"{len(counts)} media item(s)")
    pieces, starts, merged_len, previous = [], [], 0, 0
    for at, count in zip(where, counts):
        pieces += [ids[previous:at], np.full(count, -1, dtype=np.int64)]
        merged_len += at - previous
        starts.append(int(merged_len))
        merged_len += count
        previous = at + 1
    pieces.append(ids[previous:])
    return MergedPrompt(np.concatenate(pieces), tuple(starts), tuple(int(c) for c in counts))


def merge_embeddings(merged: MergedPrompt, embed: Callable[[np.ndarray], np.ndarray], rows: Sequence[np.ndarray],
                     zero_id: int | None = None) -> np.ndarray:
    """float32 [M, D]: `embed(ids)` ([n, D]) at the token positions, each item's rows at its place,
    a zero row for each token equal to `zero_id` (the pad id, as the reference's merge does)."""
    text = merged.token_ids >= 0
    width = rows[0].shape[1] if rows else None
    token_rows = np.asarray(embed(merged.token_ids[text]), dtype=np.float32)
    out = np.empty((len(merged), token_rows.shape[1] if width is None else width), dtype=np.float32)
    out[text] = token_rows
    if zero_id is not None:
        out[merged.token_ids == zero_id] = 0.0
    for start, count, r in zip(merged.media_starts, merged.media_counts, rows):
        if r.shape != (count, out.shape[1]):
            raise PromptError(f"media rows of shape {list(r.shape)} for a placeholder of {count} rows of width "
                              f"{out.shape[1]}")
        out[start:start + count] = r
    return out
