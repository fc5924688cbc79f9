"""scripts/setup_env.sh: two levels. `demo` installs only what converting and running need;
`test` completes it with the extras and llama.cpp's tools; each is stamped apart, so a demo-only
.venv is never taken for a test one and a test one serves the demo without any work. Run on a copy
of the scripts and the project's metadata, with a stand-in for the venv's python that records
what it is asked (the real setup: scripts/demo.sh and scripts/test.sh)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.support.paths import REPO

EXTRAS = "[test,interop,server]"


@pytest.fixture
def root(tmp_path):
    """A repository with the scripts, setup.cfg and pyproject.toml, and a .venv whose python
    succeeds at every pip install and fails at `pip download` (the llama.cpp tools' sdist)."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "scripts", root / "scripts")
    for name in ("setup.cfg", "pyproject.toml"):
        shutil.copy(REPO / name, root / name)
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\n'
                      'case "$*" in *"pip download"*) echo "ERROR: no network" >&2; exit 1;; esac\n')
    python.chmod(0o755)
    return root


def _setup(root, level: str, *after: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Sources setup_env.sh at LEVEL, then runs the AFTER commands; returns the run and the python
    calls it made."""
    calls = root.parent / "calls"
    calls.unlink(missing_ok=True)
    script = f"source scripts/setup_env.sh {level}; " + "; ".join(after or (":",))
    # the test command's own setup exported where its tools are: a fresh shell has none of that
    env = {k: v for k, v in os.environ.items() if not k.startswith("KIMI_K3_")}
    env["KIMI_K3_CACHE"] = str(root.parent / "cache")
    run = subprocess.run(["bash", "-c", script], cwd=root, capture_output=True, text=True, env=env, timeout=60)
    return run, calls.read_text().splitlines() if calls.exists() else []


def _stamps(root) -> list[str]:
    return sorted(re.sub(r"-[0-9a-f]{16}$", "", p.name) for p in (root / ".venv").glob(".installed-*"))


def test_the_demo_level_installs_only_what_converting_and_running_need(root):
    run, calls = _setup(root, "demo", 'echo "$KIMI_K3_VENV_STAMP"', 'echo "${KIMI_K3_LLAMA_BIN:-none}"')
    assert run.returncode == 0, run.stderr
    assert run.stderr.startswith("setup: first run: installing what converting and running need in .venv")
    assert len(calls) == 3 and calls[0].endswith("--upgrade pip")
    assert "--no-binary ggml-python --force-reinstall --no-deps ggml-python==" in calls[1]
    assert calls[2].endswith(f"-e {root}")  # no extras: no torch, no llama-cpp-python
    assert _stamps(root) == [".installed-demo"]
    stamp, llama_bin = run.stdout.splitlines()
    assert os.path.exists(stamp) and llama_bin == "none"  # llama.cpp's tools neither built nor looked for


def test_a_set_up_level_is_a_no_op_and_quiet(root):
    _setup(root, "demo")
    run, calls = _setup(root, "demo")
    assert (run.returncode, run.stdout, run.stderr, calls) == (0, "", "", [])


def test_the_test_command_completes_a_demo_only_environment(root):
    _setup(root, "demo")
    run, calls = _setup(root, "test")
    # The extras, never ggml-python again; then llama.cpp's tools, whose download fails here.
    assert calls[0].endswith(f"-e {root}{EXTRAS}") and "ggml-python" not in calls[0]
    assert calls[1].startswith("-m pip download ") and len(calls) == 2
    assert run.stderr.startswith("setup: the tests need more than the demo: completing .venv")
    assert run.returncode == 1 and "error: setup step 'llama-tools' failed" in run.stderr
    assert _stamps(root) == [".installed-demo", ".installed-test"]
    # The extras are installed: a rerun only retries the tools.
    run, calls = _setup(root, "test")
    assert len(calls) == 1 and calls[0].startswith("-m pip download ")


def test_a_test_environment_serves_the_demo_at_once(root):
    run, calls = _setup(root, "test")
    assert calls[0].endswith("--upgrade pip") and "ggml-python==" in calls[1]
    assert calls[2].endswith(f"-e {root}") and calls[3].endswith(f"-e {root}{EXTRAS}")
    run, calls = _setup(root, "demo", 'test -f "$KIMI_K3_VENV_STAMP"')
    assert (run.returncode, run.stderr, calls) == (0, "", [])


def test_a_changed_setup_cfg_sets_up_again(root):
    _setup(root, "demo")
    with open(root / "setup.cfg", "a") as cfg:
        cfg.write("\n# changed\n")
    run, calls = _setup(root, "demo")
    assert run.returncode == 0 and len(calls) == 3


def test_the_level_is_required(root):
    run, calls = _setup(root, "")
    assert run.returncode == 2 and calls == []
    assert run.stderr == "error: usage: source scripts/setup_env.sh demo|test (got '')\n"


def test_the_runtime_is_built_for_the_cpu_only():
    """README's first lines: the graph runs on the CPU; a GPU is not built (no ggml GPU flag in the
    setup) and not offered (the backend registry has no GPU executor)."""
    from ggml_graph_spec.backends.registry import BACKENDS

    cmake_args = re.findall(r'CMAKE_ARGS="([^"]*)"', (REPO / "scripts" / "setup_env.sh").read_text())
    assert cmake_args == ["-DGGML_LLAMAFILE=ON -DGGML_RPC=ON"]
    assert set(BACKENDS) == {"cpu", "rpc", "mem-budget"}
