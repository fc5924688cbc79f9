"""The sequence operations of a Model and its saved state (llama.cpp's `llama_memory_seq_*` and
`llama_state_seq_*`): what a caller does with one sequence's history between decode calls. The
format of a saved state is engine/state.py's."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gguf_arch.io.atomic import write_atomically
from gguf_arch.io.jsonfile import open_regular

from . import state as st
from .inputs import EvalError


class Sequences:
    """Model's sequence operations; Model provides `cache`, `options`, `identity`, `devices`,
    `n_seq` and the tokens each sequence holds (`_tokens`)."""

    def seq_pos(self, seq: int) -> int:
        """Tokens sequence seq holds."""
        return self.cache.pos[self._seq(seq)]

    def seq_tokens(self, seq: int) -> list[int]:
        """The tokens sequence seq holds, in order."""
        return list(self._tokens[self._seq(seq)])

    def seq_rm(self, seq: int) -> None:
        """Forget sequence seq (llama.cpp's llama_memory_seq_rm of the whole sequence): its
        caches are zeroed, the others untouched."""
        seq = self._seq(seq)
        self._write_state(seq, st.SeqState(self.identity, self._cache_types(), [], st.empty_parts(self.cache)))

    def seq_cp(self, src: int, dst: int) -> None:
        """Make dst a copy of src (a fork: both continue from src's tokens). A KDA layer's state
        is the whole history folded into one matrix, so a sequence is copied whole, never a
        part of it."""
        self._write_state(self._seq(dst), self._read_state(self._seq(src)))

    def state_get(self, seq: int) -> bytes:
        """Sequence seq's state in the format of engine/state.py."""
        return st.encode(self._read_state(self._seq(seq)))

    def state_set(self, seq: int, data: bytes, where: str = "sequence state") -> int:
        """Restore sequence seq from state_get's bytes (of this model, cache types and a fitting
        length); StateError and nothing changed otherwise. Returns the tokens it holds."""
        seq = self._seq(seq)
        state = st.decode(data, where)
        st.check_fits(state, self.cache, seq, self.identity, self._cache_types(), where)
        self._write_state(seq, state)
        return len(state.tokens)

    def state_save(self, seq: int, path: Path | str) -> int:
        """Write sequence seq's state to a file (whole or not at all); the bytes written."""
        data = self.state_get(seq)
        write_atomically(Path(path), lambda tmp: tmp.write_bytes(data))
        return len(data)

    def state_load(self, seq: int, path: Path | str) -> int:
        """Restore sequence seq from a file written by state_save; the tokens it holds. A FIFO or
        a directory under the name is refused without waiting on it, a file larger than any state
        of this context before it is read."""
        try:
            with open(open_regular(Path(path)), "rb") as f:
                size, most = os.fstat(f.fileno()).st_size, self._most_state_bytes()
                if size > most:
                    raise st.StateError(f"{path}: {size} bytes, more than any sequence state of this context "
                                        f"({most})")
                data = f.read()
        except OSError as exc:
            raise st.StateError(f"{path}: cannot read the sequence state ({exc.strerror or exc})") from None
        return self.state_set(seq, data, str(path))

    def _most_state_bytes(self) -> int:
        """An upper bound of state_get's size in this context (its header's JSON given 1 MiB)."""
        per_token = sum(self.cache.bytes_per_token().values()) + 4
        return self.cache.bytes_per_sequence() + self.cache.n_ctx * per_token + (1 << 20)

    def _cache_types(self) -> dict:
        types = self.options.cache_types()
        return {**types, "indexer": types["indexer"] if self.cache.with_indexer else None}

    def _read_state(self, seq: int) -> st.SeqState:
        self._check_devices("before reading a sequence's state")
        parts = st.read_parts(self.cache, seq, self.cache.pos[seq])
        return st.SeqState(self.identity, self._cache_types(), list(self._tokens[seq]), parts)

    def _write_state(self, seq: int, state: st.SeqState) -> None:
        self._check_devices("before writing a sequence's state")
        st.write_parts(self.cache, seq, state)
        self.cache.pos[seq] = len(state.tokens)
        self._tokens[seq] = list(state.tokens)

    def _seq(self, seq: int) -> int:
        if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or not 0 <= seq < self.n_seq:
            raise EvalError(f"sequence id {seq!r} is out of range: this context has sequences 0..{self.n_seq - 1} "
                            "(-np)")
        return int(seq)

    def _check_devices(self, when: str) -> None:
        if self.devices is not None:
            self.devices.check(when)
