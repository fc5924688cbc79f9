"""The importance matrix in llama.cpp's GGUF format (what llama-imatrix writes, llama-quantize reads).

The file (llama.cpp tools/imatrix, format of ggml 0.25.3 / llama-cpp-python 0.3.36):
  general.type        "imatrix" (and no general.architecture)
  imatrix.datasets    [str]: the calibration files
  imatrix.chunk_count u32: the chunks evaluated (llama-imatrix evaluates whole chunks only; a
                      calibration here may end with a shorter one, which counts too)
  imatrix.chunk_size  u32: tokens per chunk (-c)
and, in name order, per weight W that a matmul reads:
  W.in_sum2  F32: the sum over tokens of each input column squared. Dense W: ggml ne [ne0 * n_mat]
             (a per-head 3-D weight puts its heads' blocks one after the other); routed experts:
             ne [ne0, n_expert], column block e summed over the tokens routed to expert e.
  W.counts   F32: tokens summed. Dense: ne [1]; routed experts: ne [1, n_expert], per expert.
Sums are raw (not divided by the counts); an expert no token reached has in_sum2 and count 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from gguf import GGUFWriter, Keys

from ..errors import KimiError
from .atomic import write_atomically
from .gguf_file import open_gguf

IMATRIX_TYPE = "imatrix"  # general.type of an importance matrix
SUMS, COUNTS = ".in_sum2", ".counts"  # the two tensors of weight W: W.in_sum2, W.counts


@dataclass
class _Entry:
    sums: np.ndarray  # float32 [n_mat, ne0]
    counts: np.ndarray  # float64 [n_mat] (dense: [1])
    per_expert: bool


@dataclass
class ImatrixAccumulator:
    """Running in_sum2 and counts per weight; float32 sums as llama-imatrix keeps them."""

    entries: dict[str, _Entry] = field(default_factory=dict)
    chunks: int = 0

    def _entry(self, name: str, sums: np.ndarray, n_counts: int, per_expert: bool) -> _Entry:
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = _Entry(np.zeros(sums.shape, np.float32), np.zeros(n_counts), per_expert)
        if e.sums.shape != sums.shape:
            raise KimiError(f"imatrix: {name}: input sums of shape {sums.shape}, earlier {e.sums.shape}")
        return e

    def add_dense(self, name: str, sums: np.ndarray, n_tokens: int) -> None:
        """sums [n_mat, ne0] over one call of n_tokens tokens."""
        e = self._entry(name, sums, 1, False)
        e.sums += sums
        e.counts += n_tokens

    def add_experts(self, name: str, sums: np.ndarray, counts: np.ndarray) -> None:
        """sums [n_expert, ne0] and per-expert token counts [n_expert] over one call."""
        e = self._entry(name, sums, len(counts), True)
        e.sums += sums
        e.counts += counts

    def check_finite(self) -> None:
        bad = next((n for n, e in self.entries.items() if not np.isfinite(e.sums).all()), None)
        if bad is not None:
            raise KimiError(f"imatrix: non-finite input activations for {bad}")


def _tensors(name: str, e: _Entry) -> tuple[tuple[str, np.ndarray], tuple[str, np.ndarray]]:
    """(name, numpy array) of W.in_sum2 and W.counts; numpy shape = ggml ne reversed."""
    if e.per_expert:
        return (name + SUMS, e.sums), (name + COUNTS, e.counts.astype(np.float32)[:, None])
    return (name + SUMS, e.sums.reshape(-1)), (name + COUNTS, e.counts.astype(np.float32))


def write_imatrix(path: Path, acc: ImatrixAccumulator, datasets: Sequence[str], chunk_size: int) -> None:
    """Write `acc` as llama-imatrix does (keys in its order, tensors sorted by weight name)."""
    acc.check_finite()

    def write(tmp: Path) -> None:
        w = GGUFWriter(tmp, "")  # "" leaves general.architecture out, as llama-imatrix does
        w.add_string(Keys.General.TYPE, IMATRIX_TYPE)
        w.add_array(Keys.IMatrix.DATASETS, list(datasets))
        w.add_uint32(Keys.IMatrix.CHUNK_COUNT, acc.chunks)
        w.add_uint32(Keys.IMatrix.CHUNK_SIZE, chunk_size)
        for name in sorted(acc.entries):
            for tensor_name, array in _tensors(name, acc.entries[name]):
                w.add_tensor(tensor_name, np.ascontiguousarray(array, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write_atomically(path, write)


def imatrix_sizes(path: Path) -> dict[str, int]:
    """Weight name -> number of in_sum2 values, for every entry of an imatrix GGUF; KimiError
    (one line) for a file that is not one."""
    reader = open_gguf(path)
    kind = reader.fields.get(Keys.General.TYPE)
    if kind is None or kind.contents() != IMATRIX_TYPE:
        raise KimiError(f"{path}: not an imatrix GGUF (general.type is not {IMATRIX_TYPE!r}); make one with "
                        "llama-imatrix")
    return {t.name.removesuffix(SUMS): int(t.n_elements) for t in reader.tensors if t.name.endswith(SUMS)}
