"""Where the tests find llama.cpp's own command-line tools, and how they run them.

scripts/setup_env.sh builds the tools once per machine (scripts/build_llama_tools.sh) and exports
their directory as KIMI_K3_LLAMA_BIN; nothing is built or downloaded at test time. When the
tools are not there, a test that needs them fails under CI=true (a CI run must exercise them)
and is skipped with the reason otherwise (a bare `pytest` outside the README's setup).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from quant_rules.llama_quantize import LLAMA_BIN_ENV

TOOLS = ("llama-cli", "llama-completion", "llama-perplexity", "llama-imatrix", "llama-quantize", "llama-gguf-split")
# A whole tool run on the test models takes seconds; a hang must not stall the suite.
TIMEOUT_S = 300


def _problem() -> str:
    where = os.environ.get(LLAMA_BIN_ENV)
    if not where:
        return f"{LLAMA_BIN_ENV} is not set: run the tests through scripts/test.sh, which builds llama.cpp's tools"
    missing = [t for t in TOOLS if not os.access(Path(where) / t, os.X_OK)]
    if missing:
        return f"{LLAMA_BIN_ENV}={where} lacks {', '.join(missing)}: rerun scripts/setup_env.sh"
    return ""


def llama_bin() -> Path:
    """The tools' directory; fails the calling test under CI=true when absent, else skips it."""
    problem = _problem()
    if problem:
        _required(problem, "llama.cpp tools")
    return Path(os.environ[LLAMA_BIN_ENV])


def _required(problem: str, what: str) -> None:
    """A missing piece of the tools cache: a failure under CI=true, a skip with the reason otherwise."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} required under CI=true: {problem}")
    pytest.skip(problem)


# What the tools build keeps of llama.cpp's tree besides the binaries (scripts/build_llama_tools.sh):
# its K3 chat template among them, the public statement of K3's chat format the tests compare with.
LLAMA_SHARE_ENV = "KIMI_K3_LLAMA_SHARE"
K3_TEMPLATE = Path("models", "templates", "Kimi-K3.jinja")


def llama_k3_template() -> str:
    """llama.cpp's own Kimi K3 chat template (read to compare, never copied into the repository)."""
    where = os.environ.get(LLAMA_SHARE_ENV)
    path = Path(where) / K3_TEMPLATE if where else None
    if path is None or not path.is_file():
        _required(f"{LLAMA_SHARE_ENV} is not set: run the tests through scripts/test.sh" if path is None
                  else f"{path} is missing: rerun scripts/setup_env.sh", "llama.cpp's K3 template")
    return path.read_text(encoding="utf-8")


def llama_server_bin() -> Path:
    """llama-server of the tools build (the same rule as llama_bin)."""
    server = llama_bin() / "llama-server"
    if not os.access(server, os.X_OK):
        _required(f"{server} is missing: rerun scripts/setup_env.sh", "llama-server")
    return server


READMES = tuple(f"tools/{tool}/README.md" for tool in ("cli", "completion", "server"))  # in its tree


def llama_share() -> Path:
    """The kept llama.cpp files' directory (the tools' READMEs among them); fails the calling
    test under CI=true when they are absent, else skips it, as llama_bin."""
    where = os.environ.get(LLAMA_SHARE_ENV)
    missing = [f for f in READMES if not where or not (Path(where) / f).is_file()]
    if missing:
        _required(f"{LLAMA_SHARE_ENV} is not set: run the tests through scripts/test.sh" if not where else
                  f"{LLAMA_SHARE_ENV}={where} lacks {', '.join(missing)}: rerun scripts/setup_env.sh",
                  "llama.cpp's files")
    return Path(where)


def run_tool(tool: str, *args: str | Path, cwd: Path | None = None, binary: bool = False) -> subprocess.CompletedProcess:
    """Run one tool to completion (output as text, or as bytes); a failure shows the end of its log."""
    cmd = [str(llama_bin() / tool), *map(str, args)]
    text = {} if binary else {"text": True, "errors": "replace"}
    r = subprocess.run(cmd, capture_output=True, timeout=TIMEOUT_S, cwd=cwd, stdin=subprocess.DEVNULL, **text)
    assert r.returncode == 0, f"{tool} exited with {r.returncode}: {r.stderr[-3000:]!r}"
    return r


# llama.cpp's common logger writes from a thread of its own and nothing flushes it at exit
# (common/log.cpp, common_log_main: "this design may cause logs to be lost if not flushed before
# the program exits"): here the last lines of llama-perplexity and llama-completion were missing
# from 5 of 12 runs. A run whose output lacks its closing line is run again, up to LOGGED_TRIES
# times (all of them losing it: ~1e-3 at that rate).
LOGGED_TRIES = 8


def run_logged(tool: str, *args: str | Path, complete: Callable[[subprocess.CompletedProcess], bool],
               binary: bool = False) -> subprocess.CompletedProcess:
    """run_tool, again while `complete` says the output lost its end to the logger."""
    for _ in range(LOGGED_TRIES):
        r = run_tool(tool, *args, binary=binary)
        if complete(r):
            return r
    raise AssertionError(f"{tool}: the end of the output was missing in {LOGGED_TRIES} runs: {r.stdout[-500:]!r}")


# llama-cli is chat-first (no -no-cnv in this build): it renders the prompt with a chat template
# before tokenizing it. This template renders the user's text as it is, so the tokens llama-cli
# evaluates are the prompt's own; llama-cli then tokenizes it with special tokens parsed
# ("[BOS]" is the BOS token) and adds BOS only if the GGUF says so (ours: add_bos_token false).
RAW_TEMPLATE = "{%- for message in messages -%}{{- message['content'] -}}{%- endfor -%}"
_END_OF_REPLY = b"\n\n[ Prompt: "


def llama_cli(gguf: Path, prompt: str, n_predict: int, tmp_path: Path, *flags: str) -> str:
    """The text llama-cli prints for a single greedy turn on `prompt` (special tokens as text;
    bytes that are not valid UTF-8 come out as U+FFFD, as BPETokenizer.decode gives them)."""
    template = tmp_path / "raw.jinja"
    template.write_text(RAW_TEMPLATE, encoding="utf-8")
    cmd = [str(llama_bin() / "llama-cli"), "-m", str(gguf), "-p", prompt, "-n", str(n_predict), "--temp", "0",
           "-t", "2", "-st", "--chat-template-file", str(template), "--special", *flags]
    r = subprocess.run(cmd, capture_output=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"llama-cli exited with {r.returncode}: {r.stderr[-3000:]!r}"
    # stdout: a banner, "> PROMPT\n", the reply, "\n\n[ Prompt: N t/s | Generation: N t/s ]".
    head = b"\n> " + prompt.encode() + b"\n"
    start = r.stdout.index(head) + len(head)
    return r.stdout[start:r.stdout.index(_END_OF_REPLY, start)].decode("utf-8")
