"""The one place a chat template runs: Jinja's sandbox, bounded in time, size and depth.

A chat template comes from a file the user did not write (a checkpoint, a GGUF's
`tokenizer.chat_template`, --chat-template-file). Jinja's sandbox keeps it away from Python's
internals, not from the machine's memory and time: `{{ 'x' * 10**10 }}` allocates 10 GB in one C
call, `{{ lipsum(10**6) }}` or a quadratic loop runs for minutes. So, on top of the sandbox:

* sizes: every operation that can make a large value from small ones is checked before it runs
  (`*`, `+`, `**` and `%` of the template, the width of `center`/`ljust`/`format`/..., `join`,
  `replace`, `lipsum`); every value a Python function returns during the render is checked after
  (a `~` doubling a string in a loop), and so is the output as it is produced: MAX_CHARS each;
  integers at most MAX_INT_BITS (Python refuses to print longer ones anyway);
* time: RENDER_SECONDS of wall time and MAX_STEPS steps (calls, returns and lines of the
  template's own code: a loop that calls nothing is stopped too), whichever comes first;
* depth: MAX_DEPTH Python frames; a recursion past them ends the render, not the interpreter
  (nor the C stack).

Whatever goes wrong while rendering (a bound, `raise_exception`, `{{ 1/0 }}`, `{{ 1 + 'a' }}`, a
sandbox violation) becomes one error naming the template's source and its line.
"""
from __future__ import annotations

import gc
import json
import re
import sys
import time
import traceback
import types
from typing import Any, Callable, Iterable

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import KimiError

MAX_CHARS = 16 << 20  # a value or the whole output; a full 256K-token conversation renders to ~2 MB
MAX_INT_BITS = 1 << 14  # about 4,900 decimal digits: Python prints at most 4,300
RENDER_SECONDS = 10.0  # a chat template renders in milliseconds
# Steps: the calls, returns and template lines a render may take (a long conversation takes ~10^5).
# The same bound as the time's, but one that does not depend on the machine or its load.
MAX_STEPS = 20_000_000
MAX_DEPTH = 800  # Python frames a render may add (a macro call takes about six; K3's nests a few)
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
_DIGITS = re.compile(r"\d+")


class TemplateBound(BaseException):
    """A render went past one of the bounds: a BaseException, so that no `except Exception` on
    the template's call chain (Jinja has some) swallows it and goes on rendering."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _check_size(n: int, what: str) -> None:
    if n > MAX_CHARS:
        raise TemplateBound(f"{what} would be {n} long, more than the {MAX_CHARS} a template may make")


def _int_bits(value: Any) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _check_mul(left: Any, right: Any) -> None:
    for seq, n in ((left, right), (right, left)):
        if _size(seq) and isinstance(n, int):
            _check_size(_size(seq) * max(n, 0), "a repeated sequence")
    if isinstance(left, int) and isinstance(right, int) and _int_bits(left) + _int_bits(right) > MAX_INT_BITS:
        raise TemplateBound(f"a product of integers past {MAX_INT_BITS} bits")


def _check_pow(base: Any, exp: Any) -> None:
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and _int_bits(base) > 1:
        if (_int_bits(base) - 1) * exp > MAX_INT_BITS:
            raise TemplateBound(f"{base} ** {exp} has more than {MAX_INT_BITS} bits")


def _check_widths(fmt: Any, args: Iterable[Any]) -> None:
    """A printf or str.format string: no width or precision past MAX_CHARS, written in it or
    taken from an argument (`%*d`, `{:{}}`)."""
    if not isinstance(fmt, str):
        return
    if any(int(d) > MAX_CHARS for d in _DIGITS.findall(fmt) if len(d) <= 20) or \
            any(len(d) > 20 for d in _DIGITS.findall(fmt)):
        raise TemplateBound("a format width past the size bound")
    if ("*" in fmt or "{" in fmt) and any(isinstance(a, int) and a > MAX_CHARS for a in _flat(args)):
        raise TemplateBound("a format width past the size bound")


def _flat(args: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for a in args:
        out.extend(a if isinstance(a, (tuple, list)) else a.values() if isinstance(a, dict) else [a])
    return out


def _check_join(sep: Any, items: Any) -> None:
    total = 0
    for i, item in enumerate(items if isinstance(items, (list, tuple)) else ()):
        total += len(str(item)) + (len(sep) if i else 0)
        _check_size(total, "a joined string")


def _check_replace(text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(new, str) and isinstance(old, str):
        grows = (len(text) + 1) * max(len(new) - len(old), 0) if old == "" else \
            text.count(old) * max(len(new) - len(old), 0)
        _check_size(len(text) + grows, "a replaced string")


def _check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    """Before a call the template makes: the str methods that size their result by an argument."""
    if isinstance(obj, types.BuiltinMethodType) and isinstance(getattr(obj, "__self__", None), str):
        name, text = obj.__name__, obj.__self__
        if name in _WIDTH_METHODS and args and isinstance(args[0], int):
            n = args[0] * (text.count("\t") + 1 if name == "expandtabs" else 1)
            _check_size(len(text) + max(n, 0), f"str.{name}")
        elif name == "join" and args:
            _check_join(text, args[0])
        elif name == "replace" and len(args) >= 2:
            _check_replace(text, args[0], args[1])


def _bounded_filters(filters: dict[str, Callable]) -> None:
    real = dict(filters)

    def center(value: Any, width: int = 80) -> str:
        _check_size(len(str(value)) + (width if isinstance(width, int) else 0), "a centred string")
        return real["center"](value, width)

    def indent(s: Any, width: Any = 4, *args: Any, **kwargs: Any) -> str:
        n = width if isinstance(width, int) else len(str(width))
        _check_size(len(str(s)) + n * (str(s).count("\n") + 1), "an indented string")
        return real["indent"](s, width, *args, **kwargs)

    def format_(value: Any, *args: Any, **kwargs: Any) -> str:
        _check_widths(value, (*args, kwargs))
        return real["format"](value, *args, **kwargs)

    @jinja2.pass_eval_context
    def join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
        items = list(value) if attribute is None and not isinstance(value, (str, dict)) else value
        _check_join(d, items)
        return real["join"](eval_ctx, items, d, attribute)

    @jinja2.pass_eval_context
    def replace(eval_ctx: Any, s: Any, old: str, new: str, count: Any = None) -> str:
        _check_replace(str(s), old, new)
        return real["replace"](eval_ctx, s, old, new, count)

    filters.update(center=center, indent=indent, format=format_, join=join, replace=replace)


def _lipsum(real: Callable) -> Callable:
    def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
        _check_size(int(n) * int(max) * 12, "lipsum's text")  # words of at most 12 characters
        return real(n, html, min, max)
    return lipsum


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = True, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # The keyword arguments of the tojson that Hugging Face templates are written against (jinja2's
    # own tojson takes only indent).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox as Hugging Face renders chat templates (trim_blocks,
    lstrip_blocks, loop controls, raise_exception, tojson), with the size checks above."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                         undefined=jinja2.Undefined)
        self.filters["tojson"] = _tojson
        _bounded_filters(self.filters)
        self.globals["raise_exception"] = _raise_exception
        self.globals["lipsum"] = _lipsum(self.globals["lipsum"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_mul(left, right)
        elif operator == "**":
            _check_pow(left, right)
        elif operator == "+" and _size(left) and _size(right):
            _check_size(_size(left) + _size(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            _check_widths(left, [right])
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_call(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        # str.format and format_map are wrapped when the template reads them, not when it calls.
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_widths(value.__self__, (*args, kwargs))
            return wrapped(*args, **kwargs)
        return checked


class _Budget:
    """The render's watch: the profile hook sees every call and return (sizes, time), the trace
    hook every line of the template's own code (time, in a loop that calls nothing)."""

    def __init__(self, seconds: float, steps: int) -> None:
        self._seconds, self._deadline = seconds, time.monotonic() + seconds
        self._steps = steps
        self._tripped = False  # once raised, the hooks stay quiet while the exception unwinds

    def _trip(self, why: str) -> None:
        self._tripped = True
        raise TemplateBound(why)

    def _check_time(self) -> None:
        self._steps -= 1
        if self._tripped:
            return
        if self._steps < 0:
            self._trip(f"still rendering after {MAX_STEPS} steps (the bound on a template's work)")
        if time.monotonic() > self._deadline:
            self._trip(f"still rendering after {self._seconds:g} s (the bound on a template's time)")

    def profile(self, _frame: Any, event: str, value: Any) -> None:
        # A `~` or a macro doubling a string in a loop stops at the first result past the bound.
        if event == "return" and _size(value) > MAX_CHARS and not self._tripped:
            self._trip(f"a value of {_size(value)} items or characters, more than the {MAX_CHARS} a template "
                       "may make")
        self._check_time()

    def trace(self, frame: Any, _event: str, _value: Any) -> Callable | None:
        return self.line if frame.f_code.co_filename == "<template>" else None

    def line(self, _frame: Any, _event: str, _value: Any) -> Callable:
        self._check_time()
        return self.line

    def __enter__(self) -> "_Budget":
        self._hooks = sys.getprofile(), sys.gettrace(), sys.getrecursionlimit(), sys.unraisablehook, gc.isenabled()
        # Depth: Python's recursion limit as the caller set it may be higher than the C stack
        # holds with these hooks (a test runner raises it); a template gets MAX_DEPTH frames.
        sys.setrecursionlimit(min(self._hooks[2], _depth() + MAX_DEPTH))
        # A finalizer that runs at the depth bound (a generator of the template closed there, or
        # anyone's garbage collected there) fails with RecursionError, which Python hands to
        # sys.unraisablehook, itself then at the bound: its report is a second traceback (and under
        # pytest a failed test). The render fails or ends on its own; nothing of it is printed,
        # and no collection runs inside it.
        sys.unraisablehook = _drop_unraisable
        gc.disable()
        sys.setprofile(self.profile)
        sys.settrace(self.trace)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self._hooks[0])
        sys.settrace(self._hooks[1])
        sys.setrecursionlimit(self._hooks[2])
        sys.unraisablehook = self._hooks[3]
        if self._hooks[4]:
            gc.enable()


def _drop_unraisable(_unraisable: Any) -> None:
    """sys.unraisablehook while a template renders (_Budget.__enter__ says why)."""


def _depth() -> int:
    frame, n = sys._getframe(), 0
    while frame is not None:
        frame, n = frame.f_back, n + 1
    return n


def _template_line(exc: BaseException, template: jinja2.Template) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<template>"]
    if not frames:
        return ""
    # Jinja maps its compiled code's lines to the template's for an Exception; a bound (a
    # BaseException) passes by that, so its line is mapped here.
    line = frames[-1].lineno
    return f" line {template.get_corresponding_lineno(line) if isinstance(exc, TemplateBound) else line}"


def _why(exc: BaseException) -> str:
    if isinstance(exc, TemplateBound):
        return str(exc)
    if isinstance(exc, RecursionError):
        return "recursion too deep"
    if isinstance(exc, MemoryError):
        return "out of memory"
    if isinstance(exc, jinja2.TemplateError):
        return exc.message or type(exc).__name__
    return f"{type(exc).__name__}: {exc}"


def compile_template(text: str, where: str, error: type[KimiError] = KimiError) -> jinja2.Template:
    """The template compiled in the sandbox; `error` names `where` and the line of a syntax error."""
    try:
        with _Budget(RENDER_SECONDS, MAX_STEPS):  # Jinja computes constant expressions while compiling
            return BoundedSandbox().from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise error(f"{where}: chat template line {exc.lineno}: {exc.message}") from None
    except RecursionError:  # jinja's parser recurses on nesting: a file can make it overflow
        raise error(f"{where}: chat template nested too deeply") from None
    except TemplateBound as exc:
        raise error(f"{where}: chat template: {exc}") from None


def render(template: jinja2.Template, where: str, error: type[KimiError], **context: Any) -> str:
    """The template rendered within the bounds; any failure is `error` naming `where` and the line."""
    parts: list[str] = []
    try:
        with _Budget(RENDER_SECONDS, MAX_STEPS):
            size = 0
            for part in template.generate(**context):
                size += len(part)
                _check_size(size, "the output")
                parts.append(part)
    except (Exception, TemplateBound) as exc:  # whatever a template can make Python raise
        raise error(f"{where}: chat template{_template_line(exc, template)}: {_why(exc)}") from None
    return "".join(parts)
