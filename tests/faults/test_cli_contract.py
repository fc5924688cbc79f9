"""The command-line contract of every tool (classes 8, 10, 11): a closed stdout pipe stops it
quietly (exit 141, nothing on stderr), a usage error is one line ending in "see --help", a
combination whose option would be silently ignored is refused in one line, and error lines say
what is true. Child processes throughout (tests/support/cli.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import NO_GGML, run_cli, run_tool, tool_code
from tests.support.paths import FIXTURES, REPO

K3_TINY = FIXTURES / "k3-tiny"
K31PRO_TINY = FIXTURES / "k31pro-tiny"


def _closed_stdout(tool: str, *args) -> subprocess.CompletedProcess:
    """The tool with a stdout pipe whose reader is already gone: its first write gets EPIPE."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-c", tool_code(tool), *map(str, args)], cwd=REPO, stdout=w,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, timeout=300)
    finally:
        os.close(w)


@pytest.mark.parametrize("tool,args", [
    ("diff", lambda g, t: (K3_TINY, g)),  # `kimi-k3-diff MODEL GGUF | head -1` printed a traceback, exit 1
    ("convert", lambda g, t: (K3_TINY, "--print-tensor-types")),
    ("convert", lambda g, t: (K3_TINY, t / "o.gguf", "--dry-run")),
    ("convert", lambda g, t: (K3_TINY, t / "o.gguf")),  # the "wrote ..." line
    ("synth", lambda g, t: (t / "synth", "--dry-run")),
    ("cli", lambda g, t: ("-m", g, "-p", "hi", "-n", "2", "-c", "64", "--temp", "0")),
], ids=["diff", "print-tensor-types", "dry-run", "convert", "synth", "runner"])
def test_a_closed_pipe_stops_every_tool_quietly(k3_tiny_gguf, tmp_path, tool, args):
    res = _closed_stdout(tool, *args(k3_tiny_gguf, tmp_path))
    assert res.returncode == 141, res.stderr
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr and "error" not in res.stderr, res.stderr


@pytest.mark.parametrize("tool,args", [("convert", ()), ("diff", ()), ("synth", ()), ("convert", ("--bogus",)),
                                       ("convert", (K3_TINY, "o.gguf", "--split-max-tensors", "x")), ("cli", ()),
                                       ("cli", ("-m", "x.gguf", "--temp", "warm"))])
def test_usage_errors_are_one_line_then_see_help(tool, args):
    res = run_tool(tool, *args)
    res.one_error_line(2, "(see ", " --help)")  # "(see convert-kimi-k3 --help)": the tool named
    assert "usage:" not in res.err


REFUSED = {
    "resume-dry-run": (("OUT", "--resume", "--dry-run"), "--dry-run writes nothing; --resume would be ignored"),
    "log-json-dry-run": (("OUT", "--dry-run", "--log-json", "l.jsonl"), "--log-json would be ignored"),
    "verify-split": (("--verify", "GGUF", "--split-max-size", "1G"), "--split-max-size would be ignored"),
    "verify-outtype": (("--verify", "GGUF", "--tensor-type", "attn=q8_0"), "--tensor-type would be ignored"),
    "verify-out": (("OUT", "--verify", "GGUF"), "OUT would be ignored"),
    "print-with-out": (("OUT", "--print-tensor-types"), "--print-tensor-types converts nothing; OUT"),
    "print-split": (("--print-tensor-types", "--split-max-tensors", "5"), "--split-max-tensors would be ignored"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_silently_ignored_combinations_are_refused(k3_tiny_gguf, tmp_path, case):
    words, needle = REFUSED[case]
    args = [str(tmp_path / "o.gguf") if w == "OUT" else str(k3_tiny_gguf) if w == "GGUF" else w for w in words]
    res = run_cli(K3_TINY, *args)
    res.one_error_line(2, needle, "(see convert-kimi-k3 --help)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,needle", [
    (("--dsa", "on"), "--dsa on: the GGUF has no DSA indexer"),
    (("--dsa-path", "masked"), "--dsa-path masked: the GGUF has no DSA indexer"),
])
def test_runner_dsa_options_on_a_plain_gguf_are_refused(k3_tiny_gguf, args, needle):
    res = run_tool("cli", "-m", k3_tiny_gguf, "-p", "hi", "-n", "1", "-c", "64", *args, prelude=NO_GGML)
    res.one_error_line(2, needle)


def test_runner_dsa_path_with_dsa_off_is_refused(k31pro_tiny_gguf):
    res = run_tool("cli", "-m", k31pro_tiny_gguf, "-p", "hi", "-n", "1", "-c", "64", "--dsa", "off",
                   "--dsa-path", "gather", prelude=NO_GGML)
    res.one_error_line(2, "--dsa off runs dense attention")


# ---- messages that say what is true (class 10) ---------------------------------------------

def test_a_duplicated_index_layer_is_named_as_a_duplicate(tmp_path):
    model = Path(shutil.copytree(K31PRO_TINY, tmp_path / "model"))
    raw = json.loads((model / "config.json").read_text())
    layers = raw["text_config"]["index_layers"]
    raw["text_config"]["index_layers"] = [layers[0], *layers]
    (model / "config.json").write_text(json.dumps(raw))
    err = run_cli(model, tmp_path / "o.gguf").one_error_line(2, "without duplicates")
    assert "only in index_layers: []" not in err


def test_a_nan_metadata_value_is_not_reported_as_nan_expected_nan(k3_tiny_gguf, tmp_path):
    res = run_tool("cli", "-m", k3_tiny_gguf, "-p", "hi", "-n", "1", "-c", "64", "--override-kv",
                   "kimi-k3.kda.gate_lower_bound=float:nan", prelude=NO_GGML)
    err = res.one_error_line(2, "finite")
    assert "expected nan" not in err


def test_a_full_disk_under_the_json_log_names_the_log(tmp_path):
    prelude = ("import errno, gguf_arch.convert.progress as p\nreal = p.create\n"
               "class Full:\n"
               "    def __init__(self, f): self.f = f\n"
               "    def write(self, s): raise OSError(errno.ENOSPC, 'No space left on device')\n"
               "    def __getattr__(self, n): return getattr(self.f, n)\n"
               "p.create = lambda *a, **k: Full(real(*a, **k))\n")
    log = tmp_path / "log.jsonl"
    res = run_cli(K3_TINY, tmp_path / "o.gguf", "--quiet", "--log-json", log, prelude=prelude)
    res.one_error_line(1, f"{log}: writing the JSON progress log failed", "No space left on device")


def test_a_fifo_or_device_is_never_replaced_by_overwrite(tmp_path):
    """--overwrite replaces a file by unlinking its name: never a FIFO, a socket or a device such
    as /dev/null (a FIFO stands for them here: the same check, and harmless if it failed)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    res = run_cli(K3_TINY, tmp_path / "o.gguf", "--quiet", "--overwrite", "--log-json", fifo)
    res.one_error_line(1, f"{fifo}: is not a regular file")
    assert fifo.is_fifo()


# ---- the diff reads a split GGUF as --verify does (class 9) ---------------------------------

def test_the_diff_reads_a_split_gguf_from_its_first_part(tmp_path):
    out = tmp_path / "o.gguf"
    assert run_cli(K3_TINY, out, "--quiet", "--split-max-tensors", "120").rc == 0
    parts = sorted(tmp_path.glob("o-*-of-*.gguf"))
    assert len(parts) == 3
    res = run_tool("diff", K3_TINY, parts[0])  # was "269 missing: DIFFERENT"
    assert res.rc == 0, res.out[-2000:] + res.err
    assert "all match" in res.out and "missing" not in res.out.lower()
    run_tool("diff", K3_TINY, parts[1]).one_error_line(2, "give the first part")


# ---- every file read goes through the FIFO-safe opener (class 2) ----------------------------

@pytest.mark.parametrize("tool,args", [
    ("convert", lambda f, g, t: (K3_TINY, t / "o.gguf", "--tensor-type-file", f)),
    ("convert", lambda f, g, t: ("--verify", f, K3_TINY)),
    ("cli", lambda f, g, t: ("-m", g, "-f", f, "-n", "1", "-c", "64")),
    ("cli", lambda f, g, t: ("-m", f, "-p", "hi")),
    ("diff", lambda f, g, t: (K3_TINY, f)),
], ids=["tensor-type-file", "verify", "prompt-file", "model", "diff"])
def test_a_fifo_given_as_a_file_is_refused_not_waited_on(k3_tiny_gguf, tmp_path, tool, args):
    """No writer ever opens the FIFO: a plain open() would block until the timeout."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    res = run_tool(tool, *args(fifo, k3_tiny_gguf, tmp_path), timeout=60)
    res.one_error_line(2, str(fifo), "not a regular file")
