"""kimi-k3-cli's flags that mean what llama.cpp's mean, beyond the sampling ones: the escapes of
-p and -r (-e, the default, and --no-escape), -st, -sp, -sysf, --chat-template, --image and
--override-kv with comma-separated values, llama.cpp's other spellings of -n, --temp and -h."""
from __future__ import annotations

import pytest

from gguf_arch.errors import EXIT_BAD_INPUT
from ggml_graph_spec.runner import cli as runner_cli
from ggml_graph_spec.runner.cli import build_parser, main, process_escapes

PROMPT = "[BOS]The old woman sold honey in small"  # the fixtures' short prompt


@pytest.mark.parametrize("written, meant", [
    ("a\\nb", "a\nb"), ("tab\\there", "tab\there"), ("\\'\\\"\\\\", "'\"\\"), ("\\x41", "A"),
    ("\\xe2\\x80\\x94", "\u2014"), ("\\x4", "\\x4"), ("\\q", "\\q"), ("end\\", "end\\"), ("\\\\n", "\\n"),
])
def test_escapes_are_llama_cpps(written, meant):
    assert process_escapes(written) == meant


class _Checked(Exception):
    pass


def _checked_args(monkeypatch, *argv) -> tuple:
    """The prompt text and the reverse prompts the runner would use, just before loading."""
    seen = {}

    def stop(args, text):
        seen.update(text=text, reverse=list(args.reverse_prompt))
        raise _Checked

    monkeypatch.setattr(runner_cli, "check_media", stop)
    with pytest.raises(_Checked):
        main(["-m", "unused.gguf", "-t", "1", *map(str, argv)])
    return seen["text"], seen["reverse"]


def test_p_and_r_escapes_are_processed_unless_no_escape(monkeypatch, tmp_path):
    assert _checked_args(monkeypatch, "-p", "Q:\\nA:", "-r", "\\n") == ("Q:\nA:", ["\n"])
    assert _checked_args(monkeypatch, "--no-escape", "-p", "Q:\\nA:") == ("Q:\\nA:", [])
    prompt = tmp_path / "p.txt"
    prompt.write_text("Q:\\nA:\n", encoding="utf-8")
    assert _checked_args(monkeypatch, "-f", prompt)[0] == "Q:\\nA:\n"  # -f FILE is read as it is


def test_llama_cpps_other_spellings_are_the_same_options():
    a = build_parser().parse_args(["-m", "m", "--predict", "3", "--temperature", "0.5", "-mm", "p.gguf",
                                   "--override-kv", "a=int:1,b=str:x", "--image", "a.png,b.png", "--image", "c.png"])
    assert (a.n_predict, a.temp, str(a.mmproj), a.override_kv) == (3, 0.5, "p.gguf", [("a", 1), ("b", "x")])
    assert [[p.name for p in item] for item in a.media] == [["a.png"], ["b.png"], ["c.png"]]


def test_usage_is_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--usage"])
    assert exit_.value.code == 0 and "llama.cpp's flags refused here" in capsys.readouterr().out


def _chat(capsys, gguf, *argv) -> tuple[int, str, str]:
    rc = main(["-m", str(gguf), "-p", "Hello", "-st", "-n", "12", "-c", "512", "-t", "2", "--exact-experts",
               "--temp", "1.5", "--top-k", "0", "--top-p", "1", "--min-p", "0", "-s", "3", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_single_turn_replies_once_and_special_shows_the_special_tokens(capsys, k3_tiny_gguf):
    # -st: one reply to -p, then exit; standard input (pytest's, which refuses reads) is never read.
    rc, plain, err = _chat(capsys, k3_tiny_gguf)
    assert rc == 0, err
    rc, special, err = _chat(capsys, k3_tiny_gguf, "-sp")
    assert rc == 0, err
    assert "<|" in special and "<|" not in plain  # the same draw (-s 3), its special tokens shown or not


def test_system_prompt_file_and_template_text(capsys, tmp_path, k3_tiny_gguf):
    system = tmp_path / "system.txt"
    system.write_text("Be brief.\n", encoding="utf-8")
    template = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
    rc, _, err = _chat(capsys, k3_tiny_gguf, "-sysf", system, "--chat-template", template, "-n", 1)
    assert rc == 0, err
    assert "chat template: --chat-template" in err and "Not using system message" not in err
    rc, _, err = _chat(capsys, k3_tiny_gguf, "--chat-template", "chatml")
    assert rc == EXIT_BAD_INPUT and err.startswith("error: --chat-template chatml: ") and err.count("\n") == 1
