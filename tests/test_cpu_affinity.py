"""Default thread counts are the CPUs the process may run on (its affinity mask, as a container
or `taskset` sets it), not the machine's (console.cpu_count): the runner's compute threads
(Model.load), the RPC server's and the converter's repack workers."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO

CHILD = """
import os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import ggml
seen = []
real = ggml.ggml_backend_cpu_set_n_threads
ggml.ggml_backend_cpu_set_n_threads = lambda backend, n: (seen.append(n), real(backend, n))[1]
from gguf_arch.arch import transforms
from ggml_graph_spec.tools import rpc_server
from ggml_graph_spec.engine.model import Model
m = Model.load(sys.argv[1], n_ctx=16)
m.close()
print(os.cpu_count(), transforms.REPACK_AHEAD, sorted(set(seen)))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs an affinity mask of 2 or more CPUs to narrow")
def test_defaults_follow_the_affinity_mask(k3_tiny_gguf):
    r = subprocess.run([sys.executable, "-c", CHILD, str(k3_tiny_gguf)], env=dict(os.environ, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    machine, repack_ahead, threads = r.stdout.split(" ", 2)
    assert int(machine) >= 2 and int(repack_ahead) == 1 and threads.strip() == "[1]", r.stdout


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs an affinity mask of 2 or more CPUs to narrow")
def test_the_rpc_server_default_follows_the_affinity_mask():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one = {min(os.sched_getaffinity(0))}
    p = subprocess.Popen([sys.executable, "-m", "ggml_graph_spec.tools.rpc_server", "--port", str(port)],
                         env=dict(os.environ, PYTHONPATH=str(REPO)), stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, one))
    try:
        line = p.stderr.readline()
    finally:
        p.terminate()
        p.communicate(timeout=60)
    assert "CPU, 1 thread(s)" in line, line
