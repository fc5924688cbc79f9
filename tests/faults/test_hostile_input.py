"""Input a careless user or an attacker gives (the third round's classes 5-8 and 11-14): bytes
that are not UTF-8, a closed stdin, reserved template variables, options checked only after
loading, an OUT that names a directory, special token ids outside the vocabulary, a diff that
compared nothing, and what kimi-k3-doctor --disk is given to read. Each ends with its documented
code and one line; the runner's bad options end before any ggml object exists (NO_GGML: exit 99
otherwise). Child processes throughout (tests/support/cli.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType as T

from tests.support.cli import NO_GGML, Result, run_cli, run_tool, tool_code
from tests.support.gguf_edit import rewritten_copy
from tests.support.paths import FIXTURES, REPO

K3_TINY = FIXTURES / "k3-tiny"
BAD = os.fsdecode(b"hi\xff")  # the argument bytes 68 69 ff, as Python hands them to the tool
RUN = ("-n", "1", "-c", "64", "-t", "1")


def _runner(gguf, *args, stdin: str | bytes | None = None, close_stdin: bool = False, prelude: str = "") -> Result:
    cmd = [sys.executable, "-c", tool_code("cli", prelude), "-m", str(gguf), *map(str, args)]
    kw = {"stdin": subprocess.DEVNULL} if stdin is None and not close_stdin else {}
    if close_stdin:  # `-cnv <&-`: no descriptor 0 at all
        kw["preexec_fn"] = lambda: os.close(0)
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=300, input=stdin, **kw)
    return Result(res.returncode, res.stdout.decode(errors="replace"), res.stderr.decode(errors="replace"))


# ---- bytes that are not UTF-8 (class 6): text refused by name, paths taken as they are -----------

@pytest.mark.parametrize("args, option", [
    (("-p", BAD), "-p/--prompt"), (("-cnv", "-sys", BAD), "-sys/--system-prompt"),
    (("-p", "hi", "-r", BAD), "-r/--reverse-prompt"),
    (("-cnv", "--chat-template-kwargs", '{"x": "' + BAD + '"}'), "--chat-template-kwargs"),
    (("-p", "hi", "--override-kv", "general.name=str:" + BAD), "--override-kv"),
], ids=["prompt", "system", "reverse-prompt", "template-kwargs", "override-kv"])
def test_runner_text_that_is_not_utf8_is_refused_naming_the_option(k3_tiny_gguf, args, option):
    res = _runner(k3_tiny_gguf, *args, *RUN, prelude=NO_GGML)
    res.one_error_line(2, option, "is not valid UTF-8", "0xff")


def test_converter_text_that_is_not_utf8_is_refused(tmp_path):
    run_cli(K3_TINY, tmp_path / "o.gguf", "--tensor-type", BAD + "=q8_0").one_error_line(2, "--tensor-type", "0xff")


def test_a_path_that_is_not_utf8_is_a_path(tmp_path):
    """Linux file names are bytes: the converter writes there and says so in those bytes."""
    out = Path(os.fsdecode(bytes(tmp_path) + b"/o\xff.gguf"))
    res = subprocess.run([sys.executable, "-c", tool_code("convert"), str(K3_TINY), os.fsencode(out)], cwd=REPO,
                         capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert out.exists() and b"o\xff.gguf" in res.stdout


def _last_error_line(res: Result, code: int, *needles: str) -> None:
    """After loading the runner logs (print_info ...): its last line is the one error line."""
    lines = res.err.rstrip("\n").splitlines()
    assert res.rc == code, res.err
    assert [l for l in lines if l.startswith("error: ")] == lines[-1:] and "Traceback" not in res.err, res.err
    assert all(n in lines[-1] for n in needles), res.err


def test_a_conversation_line_that_is_not_utf8_is_refused_naming_it(k3_tiny_gguf):
    res = _runner(k3_tiny_gguf, "-cnv", "-n", "1", "-c", "1024", "-t", "1", stdin=b"hello\nbad \xff line\n")
    _last_error_line(res, 2, "standard input, line 2: not valid UTF-8")


# ---- a closed stdin (class 7) ----------------------------------------------------------------

@pytest.mark.parametrize("args", [("-cnv",), ("-i", "-no-cnv", "-p", "hi")], ids=["chat", "interactive"])
def test_a_closed_stdin_ends_a_conversation_as_the_end_of_input_does(k3_tiny_gguf, args):
    res = _runner(k3_tiny_gguf, *args, *RUN, close_stdin=True)
    assert res.rc == 0, res.err
    assert "Traceback" not in res.err and "error" not in res.err


@pytest.mark.parametrize("fd", [1, 2], ids=["stdout", "stderr"])
def test_a_closed_stdout_or_stderr_is_not_a_traceback(k3_tiny_gguf, tmp_path, fd):
    """`>&-`: the stream reads as /dev/null, and its descriptor is not handed to the next file
    opened (the GGUF being written: --verify passes on it)."""
    def run(*cmd):
        return subprocess.run([sys.executable, "-c", *cmd], cwd=REPO, capture_output=True, text=True, timeout=300,
                              preexec_fn=lambda: os.close(fd), stdin=subprocess.DEVNULL)
    runner = run(tool_code("cli"), "-m", str(k3_tiny_gguf), "-p", "hi", *RUN)
    assert runner.returncode == 0 and "Traceback" not in runner.stderr, runner.stderr
    converter = run(tool_code("convert"), str(K3_TINY), str(tmp_path / "o.gguf"))
    assert converter.returncode == 0 and "Traceback" not in converter.stderr, converter.stderr
    assert run_cli("--verify", tmp_path / "o.gguf", K3_TINY, "--quiet").rc == 0


# ---- reserved template variables, options checked before loading (classes 8, 12) -----------------

@pytest.mark.parametrize("kwargs, needle", [
    ('{"messages": 5}', "messages is set by the runner"),
    ('{"add_generation_prompt": false}', "add_generation_prompt is set by the runner"),
    ('{"bos_token": "x", "thinking": false}', "bos_token is set by the runner"),
    ("[1]", "expected a JSON object"),
    ("{", "not JSON"),
    ("[" * 100000, "nested too deeply"),
    ('{"thinking": false, "names": ["a", "\\ud800"]}', "'names[1]' is not valid Unicode"),
    ('{"\\udfff": 1}', "is not valid Unicode"),
])
def test_chat_template_kwargs_are_checked_before_loading(k3_tiny_gguf, kwargs, needle):
    res = _runner(k3_tiny_gguf, "-cnv", "--chat-template-kwargs", kwargs, *RUN, prelude=NO_GGML)
    res.one_error_line(2, "--chat-template-kwargs", needle)


@pytest.mark.parametrize("make, needle", [
    (lambda d: (os.mkfifo(d / "t.jinja"), d / "t.jinja")[1], "not a regular file"),
    (lambda d: d, "is a directory"),
    (lambda d: d / "missing.jinja", "no such file"),
    (lambda d: ((d / "t.jinja").write_text("{{ 1/0 }}"), d / "t.jinja")[1], "line 1: ZeroDivisionError"),
    (lambda d: ((d / "t.jinja").write_text("{% for %}"), d / "t.jinja")[1], "chat template line 1"),
    (lambda d: ((d / "t.jinja").write_text("{{ 'x' * 10**10 }}"), d / "t.jinja")[1], "a template may make"),
], ids=["fifo", "directory", "missing", "runtime-error", "syntax-error", "too-large"])
def test_a_chat_template_file_is_checked_before_loading(k3_tiny_gguf, tmp_path, make, needle):
    path = make(tmp_path)
    res = _runner(k3_tiny_gguf, "-cnv", "--chat-template-file", path, *RUN, prelude=NO_GGML)
    res.one_error_line(2, str(path), needle)


@pytest.mark.parametrize("args, needle", [
    (("--perplexity", "-f", "TEXT", "-c", "2"), "-c 2 is too small"),
    (("-p", "hi", "--rpc", "127.0.0.1:1", "-ts", "abc"), "--tensor-split 'abc'"),
    (("-p", "hi", "--rpc", "127.0.0.1:1", "-ts", "1,1,1"), "3 values for 2 devices"),
    (("-p", "hi", "--rpc", "localhost"), "--rpc 'localhost': expected HOST:PORT"),
    (("-p", "hi", "--rpc", "127.0.0.1:1", "--rpc-timeout", "0"), "--rpc-timeout must be a positive number"),
    (("-p", "hi", "--rpc-timeout", "5"), "--rpc-timeout needs --rpc"),
], ids=["perplexity-c2", "tensor-split", "tensor-split-count", "rpc", "rpc-timeout", "rpc-timeout-alone"])
def test_options_are_checked_before_loading(k3_tiny_gguf, tmp_path, args, needle):
    (tmp_path / "t.txt").write_text("some text " * 50)
    args = [str(tmp_path / "t.txt") if a == "TEXT" else a for a in args]
    _runner(k3_tiny_gguf, *args, "-t", "1", prelude=NO_GGML).one_error_line(2, needle)


# kimi-k3-server takes the same template, RPC and text options: checked alike before any ggml
# object exists (and before it binds its port).
@pytest.mark.parametrize("args, needle", [
    (("--chat-template-kwargs", '{"messages": 5}'), "messages is set by the runner"),
    (("--chat-template-kwargs", '{"eos_token": "x"}'), "eos_token is set by the runner"),
    (("--chat-template-kwargs", "[1]"), "expected a JSON object"),
    (("--chat-template-file", "DIR"), "is a directory"),
    (("--chat-template-file", "FIFO"), "not a regular file"),
    (("--chat-template-file", "ZERO_DIV"), "line 1: ZeroDivisionError"),
    (("--chat-template-file", "HUGE"), "a template may make"),
    (("--rpc", "127.0.0.1:1", "--rpc-timeout", "-1"), "--rpc-timeout must be a positive number"),
    (("--rpc-timeout", "5"), "--rpc-timeout needs --rpc"),
    (("--rpc", "127.0.0.1:1", "-ts", "1,1,1"), "3 values for 2 devices"),
    (("--alias", BAD), "is not valid UTF-8"),
], ids=["kwargs-messages", "kwargs-eos", "kwargs-list", "template-dir", "template-fifo", "template-runtime-error",
        "template-too-large", "rpc-timeout", "rpc-timeout-alone", "tensor-split-count", "alias-not-utf8"])
def test_server_options_are_checked_before_loading(k3_tiny_gguf, tmp_path, args, needle):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "div.jinja").write_text("{{ 1/0 }}")
    (tmp_path / "huge.jinja").write_text("{{ 'x' * 10**10 }}")
    files = {"DIR": tmp_path, "FIFO": tmp_path / "fifo", "ZERO_DIV": tmp_path / "div.jinja",
             "HUGE": tmp_path / "huge.jinja"}
    args = [str(files.get(a, a)) for a in args]
    res = run_tool("server", "-m", k3_tiny_gguf, "--port", "0", "-t", "1", *args, prelude=NO_GGML)
    res.one_error_line(2, needle)
    assert "server is up" not in res.err


def test_encode_images_refuses_an_output_that_names_a_directory(tmp_path):
    d = tmp_path / "newdir"
    run_tool("encode-images", tmp_path / "m.gguf", tmp_path / "x.png", "-o", f"{d}/").one_error_line(2, "names a directory")
    assert not d.exists()


# ---- an OUT that names a directory (class 13) --------------------------------------------------

@pytest.mark.parametrize("tool, args", [
    ("convert", (K3_TINY, "D/")), ("convert", (K3_TINY, "--outfile", "D/")),
    ("convert", (K3_TINY, "D/o.gguf", "--log-json", "D/log/")), ("convert", (K3_TINY, "D/.")),
    ("quantize", ("GGUF", "D/", "Q8_0")), ("prune", ("GGUF", "D/", "--keep-experts", "2")),
    ("calibrate", ("-m", "GGUF", "-f", "GGUF", "-o", "D/")),
], ids=["out", "outfile", "log-json", "dot", "quantize", "prune", "calibrate"])
def test_an_output_that_names_a_directory_is_refused_never_made_a_file(k3_tiny_gguf, tmp_path, tool, args):
    """`convert-kimi-k3 MODEL newdir/` wrote a file named newdir."""
    d = tmp_path / "newdir"
    args = [str(k3_tiny_gguf) if a == "GGUF" else str(a).replace("D/", f"{d}/") for a in args]
    run_tool(tool, *args).one_error_line(2, "names a directory")
    assert not d.exists()


def test_the_library_refuses_a_directory_as_out_too(tmp_path):
    from gguf_arch.convert.run import convert
    from gguf_arch.errors import KimiError

    with pytest.raises(KimiError, match="names a directory"):
        convert(K3_TINY, f"{tmp_path}/newdir/", log=lambda _m: None)
    assert list(tmp_path.iterdir()) == []


# ---- special token ids (class 14) ---------------------------------------------------------------

@pytest.mark.parametrize("key", ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"])
@pytest.mark.parametrize("value", [912, 999999])
def test_a_special_id_outside_the_vocabulary_is_refused_on_override(k3_tiny_gguf, key, value):
    res = _runner(k3_tiny_gguf, "-p", "hi", "--override-kv", f"{key}=int:{value}", *RUN, prelude=NO_GGML)
    res.one_error_line(2, key, f"{value}", "outside the vocabulary")


@pytest.mark.parametrize("key", ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
                                 "tokenizer.ggml.eot_token_id", "tokenizer.ggml.unknown_token_id"])
def test_a_special_id_outside_the_vocabulary_is_refused_on_load(k3_tiny_gguf, tmp_path, key):
    bad = rewritten_copy(k3_tiny_gguf, tmp_path / "bad.gguf", keys={key: (912, T.UINT32)})
    _last_error_line(_runner(bad, "-p", "hi", *RUN), 2, key, "912")


# ---- a diff that compared nothing (class 11) ----------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (("--layers=", "--no-globals"), "--layers must be"),
    (("--layers", ",", "--no-globals"), "--layers must be"),
    (("--layers", "13"), "outside 0..12"),
    (("--layers", "-1", "--no-globals"), "outside 0..12"),
], ids=["empty", "comma", "past-the-last", "negative"])
def test_a_diff_of_nothing_is_an_error_not_all_match(k3_tiny_gguf, args, needle):
    res = run_tool("diff", K3_TINY, k3_tiny_gguf, *args)
    res.one_error_line(2, needle)
    assert "all match" not in res.out


def test_a_diff_whose_scope_holds_no_tensor_is_an_error(k3_tiny_gguf):
    from gguf_arch.errors import KimiError
    from gguf_arch.verify import diff

    report = diff.DiffReport(str(K3_TINY), str(k3_tiny_gguf), ())
    with pytest.raises(KimiError, match="no tensor to compare"):
        diff._compared_something(report, include_globals=False)


# ---- kimi-k3-doctor --disk (class 5) --------------------------------------------------------------

@pytest.mark.parametrize("make, needle", [
    (lambda d: (os.mkfifo(d / "fifo"), d / "fifo")[1], "is not a regular file"),
    (lambda d: d / "sub" if (d / "sub").mkdir() is None else None, "is a directory"),
    (lambda d: Path("/dev/zero"), "is not a regular file"),
    (lambda d: Path("/dev/null"), "is not a regular file"),
    (lambda d: ((d / "empty").touch(), d / "empty")[1], "is empty"),
    (lambda d: d / "missing", "cannot be read"),
], ids=["fifo", "other-directory", "dev-zero", "dev-null", "empty", "missing"])
def test_doctor_measures_only_a_regular_file(k3_tiny_gguf, tmp_path, make, needle):
    disk = make(tmp_path)
    res = run_tool("doctor", k3_tiny_gguf, "--disk", disk, timeout=60)
    res.one_error_line(2, f"--disk {disk}", needle)


@pytest.mark.parametrize("make, needle", [
    (lambda d: (os.mkfifo(d / "fifo"), d / "fifo")[1], "not a regular file"),
    (lambda d: d, "is a directory"),
    (lambda d: Path("/dev/zero"), "not a regular file"),
], ids=["fifo", "directory", "device"])
def test_doctor_refuses_a_model_that_is_not_a_file_without_waiting(tmp_path, make, needle):
    model = make(tmp_path)
    run_tool("doctor", model, timeout=60).one_error_line(2, str(model), needle)


def test_doctor_measures_the_ggufs_own_directory(k3_tiny_gguf):
    res = run_tool("doctor", k3_tiny_gguf, "--disk", k3_tiny_gguf.parent, timeout=60)
    assert res.rc == 0, res.err
    assert "read speed   " in res.out and "MB/s" in res.out
