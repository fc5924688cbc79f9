"""Prompts with media against the reference's three cases: the marker becomes the processor's media
block, the text model's tokenizer gives the reference's ids, each placeholder expands to its
item's rows at the reference's positions, and the merged input rows are the reference's
`inputs_embeds` (text rows bit for bit, media rows within the vision tolerance)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, Keys
from gguf.quants import dequantize

from gguf_arch.arch.tensors import TOKEN_EMBD
from ggml_graph_spec.text.tokenizer import BPETokenizer
from ggml_graph_spec.vision.preprocess import load_media
from ggml_graph_spec.vision.prompt import (MEDIA_MARKER, MEDIA_PAD, PromptError, expand_markers, expand_placeholders,
                                           media_block, merge_embeddings)

from .conftest import files, floor, rel
from .test_tower import TOLERANCE_FACTOR

# case -> (the user's prompt with llama.cpp's marker, its media in order)
CASES = {"e2e1": (f"{MEDIA_MARKER}The picture shows", ["img_48x32"]),
         "e2e2": (f"{MEDIA_MARKER} and {MEDIA_MARKER} show", ["img_24x24", "img_37x21"]),
         "e2ev": (f"{MEDIA_MARKER}The video shows", ["vid_2x32x24"])}


@pytest.fixture(scope="module")
def text_model(k31pro_tiny_gguf):
    reader = GGUFReader(k31pro_tiny_gguf)
    t = next(t for t in reader.tensors if t.name == TOKEN_EMBD)
    table = dequantize(np.asarray(t.data), t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
    return BPETokenizer.from_gguf(reader), table, reader.fields[Keys.Tokenizer.PAD_ID].contents()


@pytest.mark.parametrize("case", CASES)
def test_the_reference_prompts_and_input_rows(exact_encoder, ref, text_model, case):
    tokenizer, table, pad_id = text_model
    prompt, names = CASES[case]
    items = [load_media(files(n), exact_encoder.cfg) for n in names]
    text = tokenizer.token_bytes(tokenizer.bos_id).decode() + expand_markers(prompt, items)
    assert text == str(ref[f"{case}/text"])
    ids = tokenizer.encode(text)
    assert ids == ref[f"{case}/input_ids"].tolist()
    assert tokenizer.special_id(MEDIA_PAD) == exact_encoder.cfg.media_placeholder_id
    rows = [exact_encoder.encode(item) for item in items]
    merged = expand_placeholders(ids, exact_encoder.cfg.media_placeholder_id, [len(r) for r in rows])
    assert list(merged.media_starts) == ref[f"{case}/image_token_starts"].tolist()
    assert list(merged.media_counts) == ref[f"{case}/image_token_counts"].tolist()
    embeds = merge_embeddings(merged, lambda i: table[i], rows, zero_id=pad_id)
    want = ref[f"{case}/inputs_embeds"]
    assert embeds.shape == want.shape
    text_rows = merged.token_ids >= 0
    assert np.array_equal(embeds[text_rows], want[text_rows])
    assert rel(embeds, ref[f"f64/{case}/inputs_embeds"]) <= TOLERANCE_FACTOR * floor(ref, "image_features")


def test_marker_counts_must_match(exact_encoder):
    item = load_media(files("img_24x24"), exact_encoder.cfg)
    assert expand_markers("look", [item, item]) == media_block(item) * 2 + "look"  # none: one per item in front
    with pytest.raises(PromptError, match="2 media marker"):
        expand_markers(f"{MEDIA_MARKER}{MEDIA_MARKER}", [item])
    with pytest.raises(PromptError, match="1 media marker"):
        expand_markers(f"a {MEDIA_MARKER} b", [item, item])
    assert expand_markers("no media", []) == "no media"


def test_placeholders_must_match_and_expand_in_place():
    merged = expand_placeholders([1, 9, 2, 9, 3], 9, [2, 3])
    assert merged.token_ids.tolist() == [1, -1, -1, 2, -1, -1, -1, 3]
    assert merged.media_starts == (1, 4) and len(merged) == 5 - 2 + 5
    with pytest.raises(PromptError, match="1 media placeholder token"):
        expand_placeholders([1, 9, 2], 9, [2, 3])
    rows = [np.full((2, 4), 7.0, np.float32), np.full((3, 4), 8.0, np.float32)]
    out = merge_embeddings(expand_placeholders([5, 9, 6, 9, 5], 9, [2, 3]), lambda i: np.ones((len(i), 4)) * i[:, None],
                           rows, zero_id=6)
    assert out[:, 0].tolist() == [5, 7, 7, 0, 8, 8, 8, 5]  # the pad id's row is zero, as the reference merges
    merged = expand_placeholders([5, 9, 6, 9, 5], 9, [2, 3])
    parts = merged.segments(rows, zero_id=6)
    assert [p.tolist() if p.dtype.kind == "i" else p[:, 0].tolist() for p in parts] == [[5], [7, 7], [0], [8, 8, 8], [5]]
    flat = np.concatenate([np.ones((len(p), 4)) * p[:, None] if p.dtype.kind == "i" else p for p in parts])
    assert np.array_equal(flat, out)  # the segments are the merged rows, run by run
    with pytest.raises(PromptError, match="media rows of shape"):
        merge_embeddings(expand_placeholders([9], 9, [2]), lambda i: np.ones((len(i), 4)), [np.ones((3, 4))])
