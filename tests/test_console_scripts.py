"""Every console script speaks the same way (README, exit codes): an error is one stderr line
`error: ...` (a usage error names --help in it), exit 2 for bad input, 1 for a runtime failure;
--version answers without other arguments; a long step shows a bar on a terminal, nothing in a pipe."""
from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from gguf_arch.errors import EXIT_BAD_INPUT, EXIT_RUNTIME

from tests.support.paths import REPO

# How each console script (setup.cfg) is started from a checkout.
TOOLS = {
    "convert-kimi-k3": [sys.executable, str(REPO / "convert_kimi_k3.py")],
    "kimi-k3-synth": [sys.executable, "-m", "gguf_arch.synth.cli"],
    "kimi-k3-diff": [sys.executable, "-m", "gguf_arch.verify.diff"],
    "kimi-k3-cli": [sys.executable, "-m", "ggml_graph_spec"],
    "kimi-k3-quantize": [sys.executable, str(REPO / "kimi_k3_quantize.py")],
    "kimi-k3-rpc-server": [sys.executable, "-m", "ggml_graph_spec.tools.rpc_server"],
    "kimi-k3-doctor": [sys.executable, "-m", "ggml_graph_spec.tools.doctor"],
    "kimi-k3-encode-images": [sys.executable, "-m", "ggml_graph_spec.tools.encode_images"],
    "kimi-k3-server": [sys.executable, "-m", "ggml_graph_spec.server.cli"],
}


def run(tool: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TOOLS[tool], *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _one_error_line(r: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "usage:" not in r.stderr and not any(f"{t}: error" in r.stderr for t in TOOLS)
    for needle in needles:
        assert needle in r.stderr, r.stderr
    return r.stderr


@pytest.mark.parametrize("tool, args, message", [
    ("convert-kimi-k3", ["model"], "the output file OUT (or --outfile OUT) is required"),
    ("convert-kimi-k3", [], "the following arguments are required: model_dir"),
    ("kimi-k3-synth", ["out", "--seed", "x"], "argument --seed: expected a whole number >= 0, got 'x'"),
    ("kimi-k3-synth", ["out", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    ("kimi-k3-diff", [], "the following arguments are required: MODEL_DIR, GGUF"),
    ("kimi-k3-cli", ["-p", "x"], "the following arguments are required: -m/--model"),
    ("kimi-k3-cli", ["-m", "x.gguf", "--bogus"], "unrecognized arguments: --bogus"),
    ("kimi-k3-quantize", ["in.gguf", "out.gguf"], "the following arguments are required: TYPE"),
    ("kimi-k3-rpc-server", ["--port", "x"], "argument --port: invalid int value: 'x'"),
    ("kimi-k3-doctor", [], "the following arguments are required: MODEL.gguf"),
    ("kimi-k3-encode-images", ["m.gguf", "a.png"], "the following arguments are required: -o/--output"),
    ("kimi-k3-server", ["--port", "80"], "the following arguments are required: -m/--model"),
])
def test_usage_errors_are_one_line_naming_help(tool, args, message):
    err = _one_error_line(run(tool, *args), EXIT_BAD_INPUT, message)
    assert err.rstrip("\n").endswith(f"(see {tool} --help)")


def test_input_and_runtime_errors_of_diff_and_synth(tmp_path, k3_tiny_dir):
    _one_error_line(run("kimi-k3-diff", tmp_path / "nothing", tmp_path / "x.gguf"), EXIT_BAD_INPUT, "nothing")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    _one_error_line(run("kimi-k3-synth", tmp_path / "full"), EXIT_RUNTIME, "directory is not empty")


@pytest.mark.parametrize("tool", TOOLS)
def test_version_needs_nothing_else(tool):
    r = run(tool, "--version")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{tool} 0.1.0 (kimi-k3-gguf)") and lines[1].startswith("ggml ")
    assert lines[2].startswith("llama.cpp")


def test_synth_help_explains_every_argument():
    from gguf_arch.synth.cli import _parser

    unexplained = [a.dest for a in _parser()._actions if not a.help]
    assert unexplained == []
    text = " ".join(run("kimi-k3-synth", "--help").stdout.split())
    assert "OUT_DIR directory to write the checkpoint into" in text
    assert "--seed N seed of every weight (default 0): the same seed and dimensions give byte-identical files" in text


def test_outfile_is_the_output_as_in_llama_cpp(tmp_path, k3_tiny_dir, k3_tiny_gguf):
    r = run("convert-kimi-k3", k3_tiny_dir, "--outfile", tmp_path / "k3.gguf", "--quiet")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "k3.gguf").read_bytes() == Path(k3_tiny_gguf).read_bytes()
    _one_error_line(run("convert-kimi-k3", k3_tiny_dir, tmp_path / "a.gguf", "--outfile", tmp_path / "b.gguf"),
                    EXIT_BAD_INPUT, "two outputs")


def _on_a_terminal(tool: str, *args) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal (stdout a pipe): the child sees a real terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # a 0x0 terminal gets no bar
    proc = subprocess.Popen([*TOOLS[tool], *map(str, args)], cwd=REPO, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        ready = select.select([master], [], [], 300)[0]
        assert ready, "no output for 300 s"
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    out = proc.stdout.read().decode()
    os.close(master)
    return proc.wait(timeout=60), out, seen.decode("utf-8", "replace")


def test_verify_and_diff_show_a_bar_on_a_terminal_only(tmp_path, k3_tiny_dir):
    gguf = tmp_path / "k3.gguf"
    assert run("convert-kimi-k3", k3_tiny_dir, gguf, "--quiet").returncode == 0
    rc, out, err = _on_a_terminal("convert-kimi-k3", "--verify", gguf, k3_tiny_dir)
    assert rc == 0 and "checking digests" in err and "comparing with k3-tiny" in err and "%|" in err
    assert out.splitlines()[-1].endswith(f"all 353 tensors match {k3_tiny_dir}")
    rc, out, err = _on_a_terminal("kimi-k3-diff", k3_tiny_dir, gguf, "--layers", "0")
    assert rc == 0 and "comparing" in err and "%|" in err
    piped = run("kimi-k3-diff", k3_tiny_dir, gguf, "--layers", "0")
    assert piped.returncode == 0 and piped.stderr == "" and piped.stdout == out
