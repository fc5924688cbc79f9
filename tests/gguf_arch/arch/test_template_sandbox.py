"""Chat templates run bounded (template_sandbox.py): a template that would take minutes or
gigabytes, or that fails at run time, is one error naming its source and line, wherever it
comes from (--chat-template-file, a GGUF's tokenizer.chat_template, a checkpoint's template at
conversion)."""
from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys

import pytest
from gguf import GGUFValueType as T

from gguf_arch.arch import template_sandbox as ts
from gguf_arch.errors import KimiError
from tests.support.cli import Result, run_cli, tool_code
from tests.support.gguf_edit import rewritten_copy
from tests.support.paths import FIXTURES, REPO

K3_TINY = FIXTURES / "k3-tiny"
TOO_LARGE = f"more than the {ts.MAX_CHARS} a template may make"


def _render(text: str, **context) -> str:
    return ts.render(ts.compile_template(text, "T.jinja"), "T.jinja", KimiError, **context)


@pytest.mark.parametrize("template, needle", [
    ("{{ lipsum(10**6) }}", TOO_LARGE),
    ("{{ 'x' * 10**10 }}", TOO_LARGE),
    ("{{ [1] * 10**9 }}", TOO_LARGE),
    ("{{ 'x'|center(10**10) }}", TOO_LARGE),
    ("{{ 'x'.ljust(10**10) }}", TOO_LARGE),
    ("{{ 'x'.zfill(10**10) }}", TOO_LARGE),
    ("{{ 'a\nb'|indent(10**9) }}", TOO_LARGE),
    ("{{ ('a' * 10000).replace('a', 'a' * 10000) }}", TOO_LARGE),
    ("{{ (['x' * 1000000] * 1000) | join }}", TOO_LARGE),
    ("{{ '-'.join(['y' * 1000000] * 100) }}", TOO_LARGE),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", TOO_LARGE),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", TOO_LARGE),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", TOO_LARGE),
    ("{{ '{:>9999999999}'.format(1) }}", "a format width past the size bound"),
    ("{{ '{:{}}'.format(1, 10**10) }}", "a format width past the size bound"),
    ("{{ '%9999999999d' % 1 }}", "a format width past the size bound"),
    ("{{ '%*d' % (10**10, 1) }}", "a format width past the size bound"),
    ("{{ '%9999999999d'|format(1) }}", "a format width past the size bound"),
    ("{{ 2**100000 }}", "has more than 16384 bits"),
    ("{% set ns = namespace(n=3) %}{% for i in range(30) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
     "a product of integers past"),
], ids=lambda v: v if len(v) < 40 else v[:40])
def test_a_template_past_the_size_bounds_stops_before_it_allocates(template, needle):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(KimiError, match="^T.jinja: chat template") as exc:
        _render(template)
    assert needle in str(exc.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB: nothing near a bomb


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + [i] %}{% endfor %}",
    "{% macro m(n) %}{% for i in range(100000) %}{{ n }}{% endfor %}{% endmacro %}"
    "{% for i in range(100000) %}{% set x = m(i) %}{% endfor %}",
], ids=["nested-loops", "quadratic-namespace", "macro-loop"])
def test_a_template_that_would_run_for_minutes_is_stopped(monkeypatch, template):
    """The work bound (steps) stops it whatever the machine's speed; the time bound too."""
    monkeypatch.setattr(ts, "MAX_STEPS", 200_000)
    with pytest.raises(KimiError, match="still rendering after 200000 steps"):
        _render(template)
    monkeypatch.setattr(ts, "MAX_STEPS", 10**12)
    monkeypatch.setattr(ts, "RENDER_SECONDS", 0.2)
    with pytest.raises(KimiError, match=r"still rendering after 0\.2 s"):
        _render(template)


@pytest.mark.parametrize("template, needle", [
    ("{{ 1/0 }}", "line 1: ZeroDivisionError: division by zero"),
    ("\n\n{{ 1 + 'a' }}", "line 3: TypeError"),
    ("{{ '%d'|format('a') }}", "line 1: TypeError: %d format"),
    ("{{ range(10**8)|list }}", "line 1: OverflowError: Range too big"),
    ("{{ 10**5000 }}", "line 1: ValueError: Exceeds the limit"),
    ("{{ raise_exception('no tools here') }}", "line 1: no tools here"),
    ("{{ undefined_thing.attr }}", "line 1: 'undefined_thing' is undefined"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "line 1: "),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion too deep"),
])
def test_a_runtime_error_is_one_line_naming_the_template_and_its_line(template, needle):
    with pytest.raises(KimiError) as exc:
        _render(template, messages=[])
    assert str(exc.value).startswith("T.jinja: chat template") and needle in str(exc.value), exc.value
    assert "\n" not in str(exc.value)


def test_the_bounds_leave_a_long_conversation_alone():
    from gguf_arch.arch.chat_template import K3_CHAT_TEMPLATE

    messages = [{"role": ("user", "assistant")[i % 2], "content": "word " * 200} for i in range(400)]
    out = ts.render(ts.compile_template(K3_CHAT_TEMPLATE, "k3"), "k3", KimiError, messages=messages,
                    add_generation_prompt=True)
    assert out.count("<|end_of_msg|>") == 401  # the conversation and the thinking-effort message


# ---- where templates come from -------------------------------------------------------------------

def _chat(gguf, *args, stdin: str = "hello\n") -> Result:
    res = subprocess.run([sys.executable, "-c", tool_code("cli"), "-m", str(gguf), "-cnv", "-n", "2", "-c", "1024",
                          "-t", "1", *args], cwd=REPO, capture_output=True, text=True, input=stdin, timeout=300)
    return Result(res.returncode, res.stdout, res.stderr)


@pytest.mark.parametrize("template, needle", [
    ("{{ 'x' * 10**10 }}", TOO_LARGE), ("{{ lipsum(10**6) }}", TOO_LARGE), ("{{ 1/0 }}", "ZeroDivisionError"),
], ids=["repeat", "lipsum", "division"])
def test_the_ggufs_own_template_is_bounded_too(k3_tiny_gguf, tmp_path, template, needle):
    gguf = rewritten_copy(k3_tiny_gguf, tmp_path / "t.gguf", keys={"tokenizer.chat_template": (template, T.STRING)})
    res = _chat(gguf)
    lines = res.err.rstrip("\n").splitlines()
    assert res.rc == 2, res.err
    assert lines[-1].startswith(f"error: {gguf}: tokenizer.chat_template: chat template line 1: ") and \
        needle in lines[-1], res.err
    assert [l for l in lines if l.startswith("error")] == lines[-1:] and "Traceback" not in res.err


def _model_with(tmp_path, *, jinja: str | None = None, config_template: str | None = None):
    model = shutil.copytree(K3_TINY, tmp_path / "model")
    if jinja is not None:
        (model / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    if config_template is not None:
        raw = json.loads((model / "tokenizer_config.json").read_text())
        raw["chat_template"] = config_template
        (model / "tokenizer_config.json").write_text(json.dumps(raw))
    return model


@pytest.mark.parametrize("source, template, needle", [
    ("jinja", "{{ 1/0 }}", "ZeroDivisionError"),
    ("jinja", "{{ 'x' * 10**10 }}", TOO_LARGE),
    ("config", "{{ 1 + 'a' }}", "TypeError"),
    ("config", "{% if messages|length > 2 %}{{ raise_exception('two turns at most') }}{% endif %}",
     "two turns at most"),
    ("config", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
], ids=["jinja-division", "jinja-repeat", "config-type", "config-raise", "config-loop"])
def test_the_converter_refuses_a_template_that_fails_naming_its_file(tmp_path, source, template, needle):
    """It renders the checkpoint's template once on a sample conversation before writing it."""
    model = _model_with(tmp_path, **({"jinja": template} if source == "jinja" else {"config_template": template}))
    where = model / ("chat_template.jinja" if source == "jinja" else "tokenizer_config.json")
    res = run_cli(model, tmp_path / "o.gguf", prelude="import gguf_arch.arch.template_sandbox as t\n"
                                                      "t.MAX_STEPS = 200_000")
    res.one_error_line(2, f"{where}: chat template line 1: ", needle)
    assert not (tmp_path / "o.gguf").exists()
