"""The tower's position terms, computed on the host per grid size (small tables, exact arithmetic).

* The learnt table `[H0, W0, C]` resized to the image's `(h, w)` patches by bilinear interpolation
  as PyTorch's `F.interpolate(..., mode="bilinear", align_corners=False)` computes it (no
  antialias, also when shrinking), flattened row-major; as-is when the grid is the table's size.
  Computed in float64 and rounded once. ggml's `ggml_interpolate` differs from PyTorch's by
  about 8e-6 on this CPU, so the graph takes the table from here.
* For a clip (t > 1) the same 2D term for every frame plus the fixed sincos time embedding
  `[sin(f w_i), cos(f w_i)]`, `w_i = 10000^(-i / (C/2))`, in float32 as the reference's numpy
  makes it. A single image (t = 1) gets no time term.
* The 2D RoPE's angles: pair j of a head rotates by `col * 10000^(-4 floor(j/2) / head_dim)` for
  even j and by `row * ...` for odd j (the same for every frame), as float32 cos and sin of the
  float32 angles, the reference's complex64 table.
"""
from __future__ import annotations

import numpy as np

from gguf_arch.arch.vision import ROPE_THETA, TIME_BASE


def _linear_weights(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lower index, upper index, weight of the upper) per output, half-pixel centres, clamped at 0."""
    src = np.maximum((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0.0)
    lo = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    hi = np.minimum(lo + 1, n_in - 1)
    return lo, hi, src - lo


def interpolate_table(table: np.ndarray, h: int, w: int) -> np.ndarray:
    """[H0, W0, C] -> [h*w, C] float32, bilinear (the table itself when (h, w) == (H0, W0))."""
    h0, w0, c = table.shape
    if (h, w) == (h0, w0):
        return np.ascontiguousarray(table.reshape(h * w, c), dtype=np.float32)
    t = table.astype(np.float64)
    ylo, yhi, wy = _linear_weights(h0, h)
    xlo, xhi, wx = _linear_weights(w0, w)
    out = np.empty((h, w, c), dtype=np.float32)
    for y in range(h):  # a row at a time: float64 [w, C] at most (a 512 x 128 grid whole would be 0.5 GB)
        row = t[ylo[y]] * (1 - wy[y]) + t[yhi[y]] * wy[y]  # [W0, C]
        out[y] = row[xlo] * (1 - wx)[:, None] + row[xhi] * wx[:, None]
    return out.reshape(h * w, c)


def time_embedding(frames: int, width: int) -> np.ndarray:
    """[frames, width] sincos table, float32 throughout as the reference's numpy computes it."""
    omega = np.arange(width // 2, dtype=np.float32)
    omega /= width / 2.0
    omega = 1.0 / np.float32(TIME_BASE) ** omega
    angles = np.arange(frames, dtype=np.float32)[:, None] * omega[None, :]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)


def position_term(table: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
    """The additive position term [t*h*w, C] of a media item's patches."""
    t, h, w = grid
    spatial = interpolate_table(table, h, w)
    if t == 1:
        return spatial
    time = time_embedding(t, table.shape[2])
    return (spatial[None, :, :] + time[:, None, :]).reshape(t * h * w, -1)


def rope_angles(grid: tuple[int, int, int], head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each float32 [t*h*w, head_dim/2]: pair j of every head of every patch."""
    t, h, w = grid
    freqs = np.float32(1.0) / np.float32(ROPE_THETA) ** (np.arange(0, head_dim, 4, dtype=np.float32)[: head_dim // 4]
                                                         / np.float32(head_dim))
    rows, cols = np.divmod(np.arange(h * w), w)
    angles = np.empty((h * w, head_dim // 2), dtype=np.float32)
    angles[:, 0::2] = cols.astype(np.float32)[:, None] * freqs[None, :]
    angles[:, 1::2] = rows.astype(np.float32)[:, None] * freqs[None, :]
    return np.tile(np.cos(angles), (t, 1)), np.tile(np.sin(angles), (t, 1))
