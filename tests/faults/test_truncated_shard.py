"""No SIGBUS: a shard truncated while one of its tensors is being read ends the conversion, and
--verify, with one line naming the shard (exit 2), nothing under OUT. The shards are read with
pread into bounded buffers (gguf_arch/io/safetensors.py); a memory-mapped read of the truncated
pages ended the process with SIGBUS. The child processes read the embedding in 4 KiB ranges, and
truncate its shard after the first two."""
from __future__ import annotations

import signal
import shutil
from pathlib import Path

import pytest

from gguf_arch.io.output_paths import manifest_path, partial_path
from tests.support.cli import run_cli
from tests.support.paths import FIXTURES

K3_TINY = FIXTURES / "k3-tiny"
EMBED = "language_model.model.embed_tokens.weight"

# Small ranges, and the shard cut to 200 bytes past the embedding's start once two were read.
_SMALL = ("import gguf_arch.io.safetensors as st, gguf_arch.arch.transforms as tr\n"
          "st.WHOLE_BYTES = 1024\ntr.CHUNK_BYTES = 4096\n")
TRUNCATE_WHILE_CONVERTING = _SMALL + (
    "import os, gguf_arch.convert.run as m\nreal = m.tensor_chunks\n"
    "def chunks(pt, out, read, *threads):\n"
    "    it = real(pt, out, read, *threads)\n"
    "    if pt.name != 'token_embd.weight':\n        return it\n"
    "    def gen():\n"
    "        for i, c in enumerate(it):\n"
    "            yield c\n"
    "            if i == 1:\n"
    "                ck = read.__self__\n"
    "                e = ck.entries[%r]\n"
    "                os.truncate(ck.model_dir / e.shard, e.start + 200)\n"
    "    return gen()\n"
    "m.tensor_chunks = chunks\n" % EMBED)


@pytest.fixture
def model(tmp_path) -> Path:
    return Path(shutil.copytree(K3_TINY, tmp_path / "model"))


def test_shard_truncated_mid_tensor_while_converting(model, tmp_path):
    out = tmp_path / "o.gguf"
    res = run_cli(model, out, "--quiet", prelude=TRUNCATE_WHILE_CONVERTING, timeout=120)
    assert res.rc != -signal.SIGBUS, "SIGBUS"
    res.one_error_line(2, "model-00014-of-000016.safetensors", EMBED, "truncated while it was being read")
    assert not out.exists() and not partial_path(out).exists() and not manifest_path(out).exists()


def test_shard_truncated_mid_tensor_while_verifying(model, tmp_path):
    out = tmp_path / "o.gguf"
    assert run_cli(model, out, "--quiet").rc == 0
    prelude = _SMALL + (
        "import os, gguf_arch.verify.diff as d\nreal = d.read_sources\n"
        "def read_sources(ckpt, plan):\n"
        "    if plan.name == 'token_embd.weight':\n"
        "        e = ckpt.entries[%r]\n"
        "        ckpt.stamps.clear()\n"
        "        os.truncate(ckpt.model_dir / e.shard, e.start + 200)\n"
        "    return real(ckpt, plan)\n"
        "d.read_sources = read_sources\n" % EMBED)
    res = run_cli("--verify", out, model, "--quiet", prelude=prelude, timeout=120)
    assert res.rc != -signal.SIGBUS, "SIGBUS"
    res.one_error_line(2, EMBED, "truncated while it was being read")
