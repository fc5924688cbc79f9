"""Bounded memory at the real model's sizes: peak RSS does not grow with the checkpoint.

Two synthetic checkpoints with the real hidden size (7168) and real MXFP4 expert shapes
(3072 x 3584), 4 and 16 experts (about 250 and 460 MB; one stacked expert tensor 23 vs 94 MB),
each converted in a fresh interpreter. If any stacked expert tensor, or the checkpoint, were held
whole, the larger one would peak at least 70 MB higher. bench/convert.py measures the same at 9 GB.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from gguf_arch.synth import plan_checkpoint, write_checkpoint
from gguf_arch.synth_config import PRESETS
from tests.faults.cli import peak_rss_kib

# The large preset's hidden size and expert shapes; attention, dense MLP and vocabulary shrunk so
# the experts are most of the bytes and the test stays a few seconds on two cores.
DIMS = dict(PRESETS["large"], layers=2, vocab=1024, intermediate=256, **{
    "dense-layers": 1, "experts-per-token": 2, "shared-experts": 0, "kda-heads": 2, "mla-heads": 2,
    "q-lora": 64, "kv-lora": 64})


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_peak_rss_is_flat_when_the_experts_quadruple(tmp_path):
    peaks, sizes = {}, {}
    for experts in (4, 16):
        model = tmp_path / f"e{experts}"
        write_checkpoint(plan_checkpoint({**DIMS, "experts": experts}, "k3", seed=1), model)
        sizes[experts] = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        out = tmp_path / f"e{experts}.gguf"
        peaks[experts] = peak_rss_kib(model, out, "--quiet", timeout=600)
        out.unlink()
        for p in model.iterdir():
            p.unlink()
    assert sizes[16] > 1.8 * sizes[4] and sizes[16] > 400e6, sizes
    # measured: 140.2 MiB for both (246 and 457 MB checkpoints)
    assert peaks[16] - peaks[4] < 32 * 1024, peaks
    assert peaks[16] < 400 * 1024, peaks
