"""keep_freed_buffers: freed large buffers are reused by the next ones, not faulted in again."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.paths import REPO

# Buffers of the converter's sizes (a 16 MiB read with its alignment slack, an expert's two
# reads, a repacked expert) and one above glibc's default mmap ceiling (32 MiB), three alive at a
# time, allocated and freed as a chunk stream does; the page faults of 8 rounds after a first.
CHILD = """
import resource, sys, numpy as np
from gguf_arch.io.heap import keep_freed_buffers
if sys.argv[1] == "keep":
    assert keep_freed_buffers()
SIZES = [(16 << 20) + 8192, 7_340_032 + 4096, 6_094_848, 1 << 20, 40 << 20]
def round_(i):
    held = []
    for k in range(12):
        a = np.empty(SIZES[(i + k) % len(SIZES)], np.uint8)
        a.fill(1)  # every page touched
        held.append(a)
        if len(held) > 3:
            held.pop(0)
round_(0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(8):
    round_(i)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    res = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return int(res.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_buffers_are_reused_without_page_faults():
    """The count is of faults, not pages (the kernel may map a large folio per fault): the control
    faults thousands of times, the kept buffers almost never."""
    default, kept = _faults("default"), _faults("keep")
    assert default > 1000, default  # the control: glibc hands the large block back to the kernel
    assert kept * 10 < default, (kept, default)
