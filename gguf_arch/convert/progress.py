"""Conversion progress: a tqdm bar over bytes per output file, and --log-json lines per tensor.

The bar (throughput and ETA from tqdm) goes to stderr and only when stderr is a terminal and
--quiet is not given: a log file or a pipe gets no carriage-return noise. The JSON log is for
machines: one object per line, written and flushed after every tensor, so a killed conversion
leaves every line it completed:
  {"file", "tensor", "file_bytes_done", "file_bytes_total", "bytes_done", "bytes_total",
   "elapsed_s", "rate_bytes_per_s"}
bytes_* count the tensor data this run writes (all files), elapsed and rate are since its start.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator

from tqdm import tqdm

from ..errors import OutputError
from ..io.gguf_writer import GGUFLayout, OutputTensor
from ..io.output_paths import create

ChunksFor = Callable[[OutputTensor], Iterable]


class Progress:
    def __init__(self, total_bytes: int, *, bar: bool, log_json: Path | None = None, replace: bool = False) -> None:
        self.total = total_bytes
        self.done = 0
        self.bar = bar
        self.start = time.monotonic()
        self._json: IO[str] | None = None
        self.log_path = log_json
        if log_json is not None:  # claimed by the run's output guard, created only now
            try:
                self._json = create(log_json, replace, "w")
            except OSError as exc:
                raise OutputError(f"{log_json}: cannot write the JSON progress log: {exc.strerror}") from None

    def track(self, path: Path, layout: GGUFLayout, chunks_for: ChunksFor) -> tuple[ChunksFor, Callable[[], None]]:
        """Wrap one file's `chunks_for` to count its bytes; returns (wrapped, close the file's bar)."""
        file_total = sum(t.nbytes for t in layout.tensors)
        bar = tqdm(total=file_total, desc=path.name, unit="B", unit_scale=True, unit_divisor=1024,
                   file=sys.stderr, disable=not self.bar, dynamic_ncols=True)
        file_done = 0

        def counted(t: OutputTensor) -> Iterator:
            nonlocal file_done
            for chunk in chunks_for(t):
                yield chunk
                n = memoryview(chunk).nbytes
                file_done += n
                self.done += n
                bar.update(n)
            self._line(path, t.name, file_done, file_total)
        return counted, bar.close

    def _line(self, path: Path, tensor: str, file_done: int, file_total: int) -> None:
        if self._json is None:
            return
        elapsed = time.monotonic() - self.start
        line = json.dumps({
            "file": path.name, "tensor": tensor, "file_bytes_done": file_done, "file_bytes_total": file_total,
            "bytes_done": self.done, "bytes_total": self.total, "elapsed_s": round(elapsed, 3),
            "rate_bytes_per_s": round(self.done / elapsed) if elapsed > 0 else 0})
        try:
            self._json.write(line + "\n")
            self._json.flush()
        except OSError as exc:  # a full disk names the log, not only its errno
            raise OutputError(f"{self.log_path}: writing the JSON progress log failed: {exc.strerror}") from None

    def close(self) -> None:
        if self._json is not None:
            self._json.close()

