"""llama.cpp's flags in kimi-k3-cli's and kimi-k3-server's parsers: every entry of the table
(flag_table.py) registered on the tool it is for, taking the values llama.cpp's flag takes, so
that a llama.cpp command line is read flag by flag as llama.cpp reads it.

A refused flag stops the parse with one line naming it (exit 2, as every usage error); an
ignored one adds its `note:` line to `llama_notes`, which the runner prints before loading.
The same table writes --help's epilog and the docs' lists (`markdown_rows`).
"""
from __future__ import annotations

import argparse
import textwrap
from typing import Any, Sequence

from .flag_table import FLAGS, NOTE, REFUSED, SPEC, LlamaFlag

NOTES = "llama_notes"


def _same(value: str, wanted: str) -> bool:
    # "0", "0.0" and "0.00" are one value, as llama.cpp parses them
    try:
        return float(value) == float(wanted)
    except ValueError:
        return value == wanted


class _LlamaFlagAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, flag: LlamaFlag, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=flag.nargs, default=None, help=argparse.SUPPRESS, **kwargs)
        self.flag = flag

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        values = [] if values is None else [values] if isinstance(values, str) else list(values)
        typed = " ".join([option_string or self.flag.spellings[0], *values])
        flag = self.flag
        if flag.kind == REFUSED and not (values and any(_same(values[0], v) for v in flag.noop_values)):
            parser.error(f"{typed}: {flag.why}")
        why = flag.why if flag.kind == NOTE else flag.noop_why
        notes = getattr(namespace, NOTES, None) or []
        setattr(namespace, NOTES, [*notes, f"note: {typed} is ignored: {why}"])


def flags_for(tool: str) -> list[LlamaFlag]:
    return [f for f in FLAGS if tool in f.tools]


def add_llama_flags(p: argparse.ArgumentParser, tool: str) -> None:
    """Register the table's flags for `tool` (a spelling the parser already has is a conflict:
    argparse refuses it, so a flag is never both implemented and in the table) and the epilog."""
    p.add_argument("--usage", action="help", help="the same as -h/--help (llama.cpp's third spelling)")
    for flag in flags_for(tool):
        p.add_argument(*flag.spellings, action=_LlamaFlagAction, flag=flag, dest=NOTES)
    p.set_defaults(**{NOTES: None})
    p.epilog = epilog(tool)
    p.formatter_class = _KeepParagraphs


def llama_notes(a: argparse.Namespace) -> list[str]:
    """The `note:` lines of the ignored flags, in command-line order."""
    return list(getattr(a, NOTES, None) or [])


def _summary(flags: list[LlamaFlag]) -> str:
    names = [f.spellings[0] + (f" (but {f.spellings[0]} {f.noop_values[0]})" if f.noop_values else "")
             for f in flags if f.why != SPEC]
    if any(f.why == SPEC for f in flags):  # dozens of them: one item
        names.append("speculative decoding's (-md, --spec-*, --draft*, -lcs, -lcd)")
    return ", ".join(names)


def epilog(tool: str) -> str:
    flags = flags_for(tool)
    ignored = [f for f in flags if f.kind == NOTE]
    refused = [f for f in flags if f.kind == REFUSED]
    return (f"llama.cpp's flags that do nothing here, each with a note: line saying why: {_summary(ignored)}.\n\n"
            f"llama.cpp's flags refused here, each with an error: line saying what to use instead: "
            f"{_summary(refused)}.")


class _KeepParagraphs(argparse.HelpFormatter):
    # argparse joins the epilog into one paragraph; the two lists stay apart.
    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(textwrap.fill(part, width, initial_indent=indent, subsequent_indent=indent,
                                         break_on_hyphens=False)
                           for part in text.split("\n\n"))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_rows(tool: str) -> list[str]:
    """The docs' table of the ignored and refused flags of `tool`: one row per reason, its flags in
    the table's order."""
    groups: dict[tuple, list[LlamaFlag]] = {}
    for f in flags_for(tool):
        groups.setdefault((f.kind, f.why, f.noop_values, f.noop_why), []).append(f)
    rows = ["| llama.cpp flags | here | why, and what to use instead |", "|---|---|---|"]
    for (kind, why, noop_values, noop_why), flags in groups.items():
        spellings = ", ".join(f"`{s}`" for f in flags for s in f.spellings)
        if kind == NOTE:
            rows.append(f"| {spellings} | ignored (a `note:`) | {_cell(why)} |")
            continue
        values = ", ".join(f"`{f.spellings[0]} {v}`" for f in flags for v in noop_values)
        tail = f"; {values}: ignored, {_cell(noop_why)}" if noop_values else ""
        rows.append(f"| {spellings} | refused (exit 2) | {_cell(why)}{tail} |")
    return rows


def docs_block(tool: str) -> list[str]:
    """The lines docs/run.md (kimi-k3-cli) or docs/server.md (kimi-k3-server) holds between its two
    markers: the table, as markdown_rows writes it (tests/ggml_graph_spec/test_llama_flags.py)."""
    return [f"<!-- {tool}: llama.cpp's flags, written from ggml_graph_spec/runner/flag_table.py -->",
            *markdown_rows(tool), f"<!-- end of {tool}'s llama.cpp flags -->"]
