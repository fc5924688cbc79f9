"""The library API: images (or clips) in, their embedding rows in the text model's width out.

    with VisionEncoder.open("mmproj.gguf") as enc:            # exact path: F32 everywhere
        rows = enc.encode(load_media(["a.png"], enc.cfg))      # float32 [N, D_text]
    encode_images("mmproj.gguf", ["a.png", ["f0.png", "f1.png"]])  # one list entry per media item

Each media item is its own graph (full attention within the item only, as the reference's
block-diagonal attention over packed items gives), computed on ggml's CPU backend with one
ggml-alloc allocator kept for the encoder's life.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence, Union

import ggml
import numpy as np
from PIL import Image

from gguf_arch.arch.vision import VisionConfig
from gguf_arch.errors.signals import native_call
from gguf_arch.io.console import cpu_count

from .preprocess import MediaItem, load_media, media_item
from .tower import VisionGraph, build_tower
from .weights import MmprojFile, VisionWeights, load_mmproj

# Graph nodes per encoder block (with its RoPE and records) and for the rest, generously.
_NODES_PER_BLOCK = 64
_NODES_OTHER = 256

Media = Union[str, Path, Image.Image, MediaItem, Sequence[Union[str, Path, Image.Image]]]


class VisionEncoder:
    """A loaded mmproj and the CPU backend it runs on."""

    def __init__(self, weights: VisionWeights, threads: int | None = None) -> None:
        self.weights = weights
        self.backend = ggml.ggml_backend_cpu_init()
        ggml.ggml_backend_cpu_set_n_threads(self.backend, threads or cpu_count())
        self._galloc = ggml.ggml_gallocr_new(ggml.ggml_backend_get_default_buffer_type(self.backend))

    @classmethod
    def open(cls, source: MmprojFile | Path | str, *, exact: bool = True, threads: int | None = None
             ) -> "VisionEncoder":
        """source: an mmproj path, or the file weights.open_mmproj checked."""
        return cls(load_mmproj(source, exact=exact), threads)

    @property
    def cfg(self) -> VisionConfig:
        return self.weights.cfg

    def n_rows(self, item: MediaItem) -> int:
        """The rows `encode(item)` gives: one per merge x merge group of a frame's patches."""
        return item.grid[1] * item.grid[2] // self.cfg.merge_kernel ** 2

    def encode(self, item: MediaItem, taps: bool = False) -> np.ndarray | tuple[np.ndarray, dict[str, np.ndarray]]:
        """The item's rows [N, D_text] float32; with taps also every stage (tower.STAGES, blockN)
        as numpy [rows, width]."""
        n_nodes = _NODES_PER_BLOCK * self.cfg.num_layers + _NODES_OTHER
        ctx = ggml.ggml_init(ggml.ggml_init_params(
            mem_size=ggml.ggml_tensor_overhead() * n_nodes * 2 + ggml.ggml_graph_overhead_custom(n_nodes, False),
            mem_buffer=None, no_alloc=True))
        try:
            g = VisionGraph(ctx, ggml.ggml_new_graph_custom(ctx, n_nodes, False), self.weights, taps)
            out = build_tower(g, item.pixel_values, item.grid)
            ggml.ggml_set_output(out)
            ggml.ggml_build_forward_expand(g.gf, out)
            self._compute(g)
            rows = _read(out)
            return (rows, {stage: _read(t) for stage, t in g.records.items()}) if taps else rows
        finally:
            ggml.ggml_free(ctx)

    def _compute(self, g: VisionGraph) -> None:
        if not ggml.ggml_gallocr_alloc_graph(self._galloc, g.gf):
            raise MemoryError("ggml-alloc could not allocate the vision graph")
        for t, value in g.inputs:
            ggml.ggml_backend_tensor_set(t, value.ctypes.data_as(ctypes.c_void_p), 0, value.nbytes)
        with native_call():  # seconds of C for a large image: a stop signal ends the process at once
            status = ggml.ggml_backend_graph_compute(self.backend, g.gf)
        if status != ggml.GGML_STATUS_SUCCESS:
            raise RuntimeError(f"ggml graph compute failed with status {status}")

    def media(self, media: Media) -> MediaItem:
        """A media item from a path, a PIL image, a clip's frames (a list of either), or as given."""
        if isinstance(media, MediaItem):
            return media
        if isinstance(media, (str, Path, Image.Image)):
            media = [media]
        if all(isinstance(m, Image.Image) for m in media):
            return media_item(list(media), self.cfg, "the image" if len(media) == 1 else "the clip")
        return load_media(list(media), self.cfg)

    def close(self) -> None:
        if self._galloc is not None:
            ggml.ggml_gallocr_free(self._galloc)
            ggml.ggml_backend_free(self.backend)
            self._galloc = None
        self.weights.close()

    def __enter__(self) -> "VisionEncoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read(t) -> np.ndarray:
    out = np.empty((ggml.ggml_nrows(t), t.contents.ne[0]), dtype=np.float32)
    ggml.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
    return out


def encode_images(model: VisionEncoder | Path | str, images: Sequence[Media], *, exact: bool = True,
                  threads: int | None = None) -> list[np.ndarray]:
    """Each media item's embedding rows, float32 [N_i, D_text], in order. `model`: an open encoder
    (kept open) or an mmproj path (opened and closed here)."""
    if isinstance(model, VisionEncoder):
        return [model.encode(model.media(m)) for m in images]
    with VisionEncoder.open(model, exact=exact, threads=threads) as enc:
        items = [enc.media(m) for m in images]  # every file read before anything is computed
        return [enc.encode(item) for item in items]
