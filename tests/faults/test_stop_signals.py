"""Every console script stops alike on SIGINT and SIGTERM, from its first line to its last
(gguf_arch/errors/signals.py): 130 or 143 and one `error: interrupted (SIGNAME)` line, during its
imports, in its body, inside a ggml call, while the main thread waits on a worker's queue.

Each signal here lands at a point the test chooses (a hook in the child raises it there), so the
outcome never depends on timing; test_signal_storm.py sends them at random moments instead."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.support.cli import REPO, run_cli, run_tool, tool_code
from tests.support.held import interrupt_mid_write
from tests.support.paths import FIXTURES

K3_TINY = FIXTURES / "k3-tiny"
TOOLS = {"convert": (K3_TINY, "OUT"), "cli": ("-m", "GGUF", "-p", "hi", "-n", "1"), "diff": (K3_TINY, "GGUF"),
         "synth": ("OUT",), "quantize": ("GGUF", "OUT", "Q8_0"), "calibrate": ("-m", "GGUF", "-f", "x", "-o", "OUT"),
         "prune": ("GGUF", "OUT", "--keep-experts", "2"), "doctor": ("GGUF",), "rpc-server": ("--port", "0"),
         "encode-images": ("GGUF", "x.png", "-o", "OUT")}
# Raise `sig` in the child when numpy or ggml starts to load: the first heavy import of every
# tool, after the handlers were installed (the tool's module installs them before anything else).
AT_NUMPY = """
import signal, sys
class _Hook:
    def find_spec(self, name, path=None, target=None):
        if name in ("numpy", "ggml"):
            sys.meta_path.remove(self)
            signal.raise_signal({sig})
        return None
sys.meta_path.insert(0, _Hook())
"""


def _args(tool: str, gguf, tmp_path) -> list[str]:
    return [str(tmp_path / "out") if a == "OUT" else str(gguf) if a == "GGUF" else str(a) for a in TOOLS[tool]]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("tool", TOOLS)
def test_a_stop_signal_during_a_tools_imports_is_the_documented_line(k3_tiny_gguf, tmp_path, tool, sig):
    """Ctrl-C while the converter imported its modules printed a KeyboardInterrupt traceback."""
    res = run_tool(tool, *_args(tool, k3_tiny_gguf, tmp_path), prelude=AT_NUMPY.format(sig=int(sig)))
    res.one_error_line(128 + sig, f"error: interrupted ({signal.Signals(sig).name})")
    assert not (tmp_path / "out").exists()


# kimi-k3-server's documented end on a stop signal is 0 with a `stopping (SIGNAME)` line, from its
# first line on: during its imports, and inside the ggml graph of the load's warm-up (the first
# graph computed), where the watcher thread ends the process.
@pytest.mark.parametrize("where", ["imports", "warm-up"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_server_stops_with_0_on_a_stop_signal_from_its_first_line(k3_tiny_gguf, sig, where):
    prelude = AT_NUMPY.format(sig=int(sig)) if where == "imports" else IN_A_GRAPH.format(sig=int(sig), n=1)
    res = run_tool("server", "-m", k3_tiny_gguf, "--port", "0", "-c", "128", "-t", "1", prelude=prelude)
    lines = res.err.rstrip("\n").splitlines()
    assert res.rc == 0, res.err
    # Inside the graph the watcher ends the process; just after it the load's interrupt unwinds
    # (`... while loading the model`): either way the same code and line.
    assert lines[-1].startswith(f"stopping ({signal.Signals(sig).name})"), res.err
    assert "error" not in res.err and "Traceback" not in res.err and "Exception ignored" not in res.err
    if where == "warm-up":
        assert any(l.startswith("server is up on ") for l in lines), res.err


# Raise `sig` from inside the sampler at its third token: Python code in the middle of generation.
AT_THIRD_TOKEN = """
import signal
import ggml_graph_spec.generation.sampling as s
_real, _n = s.Sampler.__call__, [0]
def _call(self, logits):
    _n[0] += 1
    if _n[0] == 3:
        signal.raise_signal({sig})
    return _real(self, logits)
s.Sampler.__call__ = _call
"""
# Send `sig` to the process from inside the n-th ggml graph computed: the main thread is in a
# ggml call (the watcher thread ends the process) or has just left it (the handler raises).
IN_A_GRAPH = """
import os, signal
import ggml_graph_spec.backends.cpu as c
_real, _n = c.Executor._run, [0]
def _run(self, g):
    _n[0] += 1
    if _n[0] == {n}:
        os.kill(os.getpid(), {sig})
    return _real(self, g)
c.Executor._run = _run
"""


@pytest.mark.parametrize("where", [AT_THIRD_TOKEN, IN_A_GRAPH.replace("{n}", "3")], ids=["sampling", "ggml-graph"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_during_generation_prints_the_timings_then_the_line(k3_tiny_gguf, sig, where):
    """SIGTERM exited 143 without the timings a Ctrl-C prints; now both print them."""
    res = run_tool("cli", "-m", k3_tiny_gguf, "-p", "hi", "-n", "50", "--ignore-eos", "--temp", "0", "-c", "128",
                   "-t", "1", prelude=where.format(sig=int(sig)))
    lines = res.err.rstrip("\n").splitlines()
    assert res.rc == 128 + sig, res.err
    assert lines[-1] == f"error: interrupted ({signal.Signals(sig).name})", res.err
    assert [l for l in lines if l.startswith("error:")] == lines[-1:], res.err
    assert any(l.startswith("kimi_k3_perf: ") and "eval time" in l for l in lines), res.err
    assert "Traceback" not in res.err and "Exception ignored" not in res.err


# A Ctrl-C inside the third graph of a reply, whose computation then lasts 40 times the grace a
# call on an RPC server gets: as on a machine so loaded that one local token takes seconds.
SLOW_LOCAL_GRAPH = """
import os, signal, time
import gguf_arch.errors.signals as sg
import ggml_graph_spec.backends.cpu as c
sg.GRACE_S = 0.05
_real, _n = c.Executor._run, [0]
def _run(self, g):
    _n[0] += 1
    if _n[0] == 3:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(40 * sg.GRACE_S)
    return _real(self, g)
c.Executor._run = _run
"""


def test_a_first_ctrl_c_waits_for_a_local_graph_however_long_it_takes(k3_tiny_gguf):
    """The first Ctrl-C of a reply ends the reply, not the program, even when the token under way
    takes long: only a call on an RPC server (which may never answer) is cut short after the grace
    (test_rpc_hostile.py). The conversation then reads the end of its input and ends with 0."""
    args = ["-m", str(k3_tiny_gguf), "-cnv", "--ignore-eos", "-c", "2048", "-t", "1", "-n", "500"]
    res = subprocess.run([sys.executable, "-c", tool_code("cli", SLOW_LOCAL_GRAPH), *args], cwd=REPO,
                         input="Hello there\n", capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert res.returncode == 0, res.stderr
    assert "error:" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert "kimi_k3_perf: " in res.stderr


# The failure of the Ctrl-C test under load, made to happen every time: the signal comes while the
# main thread is between a Condition's wait and the re-acquisition of its lock (queue.get, a
# future's result). Raised there, KeyboardInterrupt left the lock released and `with` released it
# again: "RuntimeError: release unlocked lock", exit 1 instead of 130.
IN_A_QUEUE_WAIT = """
import signal, sys, threading
import gguf_arch.io.gguf_writer as gw
_create = gw.create
def _profile(frame, event, arg):
    if event == "call" and frame.f_code is threading.Condition._acquire_restore.__code__:
        sys.setprofile(None)
        signal.raise_signal(signal.SIGINT)
def create(*a, **k):
    f = _create(*a, **k)
    sys.setprofile(_profile)  # from the first write on, in the main thread
    return f
gw.create = create
"""


@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_stop_signal_in_a_queue_wait_is_the_interrupt_not_a_broken_lock(tmp_path, threads):
    res = run_cli(K3_TINY, tmp_path / "o.gguf", "--quiet", "-j", threads, prelude=IN_A_QUEUE_WAIT)
    res.one_error_line(130, "error: interrupted (SIGINT); no output written (its partial file was removed)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_while_the_writer_waits_ends_the_run_at_the_next_chunk(tmp_path, sig):
    ctl, out = tmp_path / "ctl", tmp_path / "out"
    ctl.mkdir()
    out.mkdir()
    rc, err = interrupt_mid_write(ctl, K3_TINY, out / "o.gguf", "--quiet", sig=sig)
    assert rc == 128 + sig, err
    assert err == f"error: interrupted ({signal.Signals(sig).name}); no output written (its partial file was " \
                  "removed); run the conversion again (--resume has nothing to keep)\n", err
    assert list(out.iterdir()) == []
