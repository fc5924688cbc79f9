"""Chat templates built by Hypothesis from a grammar of Jinja's constructs (literals, the
operators, filters, method calls, globals, loops over ranges, namespace assignments, macros,
conditionals), many of them hostile sizes: each renders within the bounds or fails with one
KimiError line naming the template. Never a traceback, never an output or a value past the size
bound, never a render past the work bound (MAX_STEPS, lowered here so that a runaway shows in
seconds), and the process's peak memory stays far below any bomb's."""
from __future__ import annotations

import resource

from hypothesis import given
from hypothesis import strategies as st

from gguf_arch.arch import template_sandbox as ts
from gguf_arch.errors import KimiError

from .harness import FUZZ, assert_clean

STEPS = 100_000
BIG = st.sampled_from([0, 1, 2, 3, 7, 64, 4096, 10**5, 10**6, 10**9, 10**10, 2**31, 2**63, -1, -(10**9)])
NUMBER = st.integers(-5, 70) | BIG
STRING = st.sampled_from(["''", "'x'", "'ab\\ncd'", "'%d'", "'%s|%s'", "'{}'", "'{:>{}}'", "'%*d'", "'<|sep|>'"])
NAMES = st.sampled_from(["messages", "ns.v", "x", "loop.index", "undefined_name", "bos_token"])
BINOPS = st.sampled_from(["+", "-", "*", "**", "/", "//", "%", "~", "==", "<", "and", "or", "in"])
FILTERS = st.sampled_from(["center({})", "indent({})", "format({})", "join", "replace('x', 'xxxxxxxxxx')", "list",
                           "string", "length", "tojson", "wordwrap({})", "batch({})", "slice({})", "truncate({})",
                           "first", "last", "sum", "sort", "unique", "reverse", "upper", "trim", "int", "float",
                           "default({})", "abs", "round", "e", "safe"])
METHODS = st.sampled_from(["ljust({})", "rjust({})", "center({})", "zfill({})", "expandtabs({})", "join({})",
                           "replace('x', {})", "format({})", "split()", "strip()", "upper()", "count('x')",
                           "startswith('x')", "__class__"])
GLOBALS = st.sampled_from(["range({})", "lipsum({})", "dict(a={})", "namespace(v={})", "cycler(1, 2).next()",
                           "joiner()()", "raise_exception('r')"])


def _expressions() -> st.SearchStrategy[str]:
    leaf = NUMBER.map(str) | STRING | NAMES | st.sampled_from(["[1, 2]", "(1, 'a')", "{'k': 'v'}", "none", "true"])

    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        binop = st.tuples(inner, BINOPS, inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})")
        filt = st.tuples(inner, FILTERS, inner).map(lambda t: f"({t[0]})|{t[1].format(t[2])}")
        meth = st.tuples(inner, METHODS, inner).map(lambda t: f"({t[0]}).{t[1].format(t[2])}")
        glob = st.tuples(GLOBALS, inner).map(lambda t: t[0].format(t[1]))
        cond = st.tuples(inner, inner, inner).map(lambda t: f"({t[0]} if {t[1]} else {t[2]})")
        return binop | filt | meth | glob | cond | inner.map(lambda e: f"[{e}]") | inner.map(lambda e: f"-{e}")
    return st.recursive(leaf, extend, max_leaves=8)


EXPR = _expressions()


def _statements() -> st.SearchStrategy[str]:
    leaf = EXPR.map(lambda e: "{{ " + e + " }}") | st.just("text") | \
        EXPR.map(lambda e: "{% set ns.v = " + e + " %}") | EXPR.map(lambda e: "{% set x = " + e + " %}")

    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        loop = st.tuples(NUMBER, inner).map(lambda t: "{% for i in range(" + str(t[0]) + ") %}" + t[1] + "{% endfor %}")
        each = st.tuples(EXPR, inner).map(lambda t: "{% for i in " + t[0] + " %}" + t[1] + "{% endfor %}")
        cond = st.tuples(EXPR, inner, inner).map(lambda t: "{% if " + t[0] + " %}" + t[1] + "{% else %}" + t[2] +
                                                  "{% endif %}")
        macro = inner.map(lambda b: "{% macro m(n) %}" + b + "{{ m(n) if n else '' }}{% endmacro %}{{ m(1) }}")
        seq = st.lists(inner, min_size=2, max_size=3).map("".join)
        return loop | each | cond | macro | seq
    return st.recursive(leaf, extend, max_leaves=6).map(lambda body: "{% set ns = namespace(v=1) %}" + body)


@FUZZ
@given(template=_statements())
def test_fuzz_a_template_renders_within_the_bounds_or_fails_in_one_line(monkeypatch, template):
    monkeypatch.setattr(ts, "MAX_STEPS", STEPS)
    try:
        out = ts.render(ts.compile_template(template, "fuzz.jinja"), "fuzz.jinja", KimiError,
                        messages=[{"role": "user", "content": "hi"}], bos_token="<s>")
    except Exception as exc:  # noqa: BLE001 - which exception it is, is the point
        msg = assert_clean(exc)
        assert msg.startswith("fuzz.jinja: chat template"), msg
        return
    assert len(out) <= ts.MAX_CHARS


def test_fuzzing_kept_the_memory_far_below_a_bomb():
    """Run after the fuzz test (file order): a bomb that got through would have taken gigabytes."""
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 2 * 1024 * 1024  # KiB
