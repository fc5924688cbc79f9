"""Every flag of the flag tables of llama-cli's, llama-completion's and llama-server's READMEs (the
llama.cpp tree the setup keeps, KIMI_K3_LLAMA_SHARE), on the matching tool (llama-cli and
llama-completion: kimi-k3-cli; llama-server: kimi-k3-server), run in this process up to the point
where the model would load: each spelling is accepted (no line about it), ignored (one `note:`
line naming it) or refused (one `error:` line naming it, exit 2), as runner/flag_table.py says;
never a line about another flag. Also: an unknown option is refused by its own name, never read
as a one-letter option and a value, and the table's own entries, noop values included."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from gguf_arch.errors import EXIT_BAD_INPUT
from gguf_arch.io.console import UsageError
from ggml_graph_spec.runner import cli as runner_cli
from ggml_graph_spec.runner.flag_table import CLI, FLAGS, REFUSED, SERVER
from ggml_graph_spec.runner.flags import _same, docs_block, flags_for, llama_notes
from ggml_graph_spec.server import cli as server_cli
from tests.interop.llama_tools import READMES, llama_share
from tests.support.paths import REPO

TOOL_OF = dict(zip(READMES, (CLI, CLI, SERVER)))  # llama-cli, llama-completion, llama-server
MAIN = {CLI: runner_cli, SERVER: server_cli}
SPELLING = re.compile(r"-{1,2}[A-Za-z][\w.\-]*")
NUMERIC = {"N", "SEED", "INDEX", "SECONDS", "SIMILARITY", "PORT", "L", "P"}


def readme_rows(text: str) -> list[tuple[list[str], str]]:
    """(spellings, metavar) of each row of the README's `| Argument | Explanation |` tables."""
    rows, inside = [], False
    for line in text.splitlines():
        if re.match(r"\|\s*Argument\s*\|\s*Explanation\s*\|", line):
            inside = True
        elif not line.startswith("|"):
            inside = False
        elif inside and line.startswith("| `"):
            cell = line.split("`")[1]
            words = re.split(r"[ ,]+", cell)
            spellings = [w for w in words if SPELLING.fullmatch(w)]
            rows.append((spellings, cell[cell.rindex(spellings[-1]) + len(spellings[-1]):].strip(" ,")))
    return rows


def test_the_readme_parser_reads_a_table():
    text = ("| Argument | Explanation |\n| --- | --- |\n| `-ngl, --gpu-layers, --n-gpu-layers N` | x |\n"
            "| `-fa, --flash-attn [on\\|off\\|auto]` | y |\n| `--control-vector-layer-range START END` | z |\n\nafter\n"
            "| `--not-a-flag-row` | no |\n")
    assert readme_rows(text) == [(["-ngl", "--gpu-layers", "--n-gpu-layers"], "N"),
                                 (["-fa", "--flash-attn"], "[on\\|off\\|auto]"),
                                 (["--control-vector-layer-range"], "START END")]


def generic_values(metavar: str) -> list[str]:
    """A value of the shape llama.cpp's metavar asks for (a table flag takes any of its shape)."""
    if not metavar:
        return []
    if re.fullmatch(r"[A-Z]+ [A-Z]+", metavar):
        return ["1", "2"]
    choices = re.match(r"[\[{<]([\w.]+)", metavar)
    if choices:
        return [choices.group(1)]
    return ["1"] if metavar in NUMERIC else ["x"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, k31pro_tiny_gguf, k31pro_tiny_mmproj, k31pro_tiny_dir) -> dict[str, str]:
    d = tmp_path_factory.mktemp("flags")
    (d / "prompt.txt").write_text("Hello", encoding="utf-8")
    (d / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    (d / "schema.json").write_text('{"type": "object"}', encoding="utf-8")
    (d / "g.gbnf").write_text('root ::= "yes" | "no"', encoding="utf-8")
    image = k31pro_tiny_dir / "vision" / "img_32x32.png"
    frames = ",".join(str(k31pro_tiny_dir / "vision" / f"vid_2x32x24_frame{i}.png") for i in (0, 1))
    return {"model": str(k31pro_tiny_gguf), "mmproj": str(k31pro_tiny_mmproj), "text": str(d / "prompt.txt"),
            "template": str(d / "t.jinja"), "image": str(image), "frames": frames, "dir": str(d / "slots"),
            "schema": str(d / "schema.json"), "grammar": str(d / "g.gbnf")}


def accepted_values(files: dict[str, str]) -> dict[str, list[str]]:
    """The values (and companion flags) an accepted flag is walked with: ones the checks take."""
    one = {"-m": files["model"], "--model": files["model"], "-mm": files["mmproj"], "--mmproj": files["mmproj"],
           "-f": files["text"], "--file": files["text"], "-sysf": files["text"], "--system-prompt-file": files["text"],
           "--chat-template-file": files["template"], "--chat-template": "{{ messages[0]['content'] }}",
           "-ctk": "f16", "--cache-type-k": "f16", "-c": "64", "--ctx-size": "64", "-b": "64", "--batch-size": "64",
           "-ub": "32", "--ubatch-size": "32", "--override-kv": "kimi-k3.attention.indexer.top_k=int:8",
           "--rpc": "127.0.0.1:50052", "-ts": "1,1", "--tensor-split": "1,1", "--host": "127.0.0.1",
           "--port": "0", "--slot-save-path": files["dir"], "-a": "k3", "--alias": "k3", "--api-key": "key",
           "-to": "5", "--timeout": "5", "--image": files["image"], "--video": files["frames"],
           "-p": "Hello", "--prompt": "Hello", "-sys": "be brief", "--system-prompt": "be brief",
           "-r": "User:", "--reverse-prompt": "User:", "-j": "{}", "--json-schema": "{}", "-jf": files["schema"],
           "--json-schema-file": files["schema"], "--grammar": 'root ::= "a"', "--grammar-file": files["grammar"],
           "--reasoning-format": "none", "--reasoning-budget": "16", "-rea": "on", "--reasoning": "on",
           "--reasoning-effort": "high", "--chat-template-kwargs": '{"thinking": true}'}
    out = {flag: [value] for flag, value in one.items()}
    for flag in ("--image", "--video"):
        out[flag] += ["-mm", files["mmproj"]]
    for flag in ("-ts", "--tensor-split"):
        out[flag] += ["--rpc", "127.0.0.1:50052"]
    for flag in ("-no-cnv", "--no-conversation"):
        out[flag] = ["-p", "Hello"]
    return out


class _Loading(Exception):
    """Raised where the model would be loaded (kimi-k3-cli) or the port bound (kimi-k3-server)."""


def _stop(*_args, **_kwargs):
    raise _Loading


def run_tool(tool: str, argv: list[str], monkeypatch, capsys) -> tuple[str, str]:
    """(outcome, stderr): outcome "loaded" (it got to the load), "refused" (exit 2), or "exit"."""
    monkeypatch.setattr(runner_cli, "load", _stop)
    monkeypatch.setattr(server_cli, "bind", _stop)
    try:
        rc = MAIN[tool].main(argv)
    except _Loading:
        return "loaded", capsys.readouterr().err
    except SystemExit as exc:  # -h, --usage
        return ("exit" if exc.code in (0, None) else f"exit {exc.code}"), capsys.readouterr().err
    err = capsys.readouterr().err
    return ("refused" if rc == EXIT_BAD_INPUT else f"rc {rc}"), err


def entry(tool: str, spelling: str):
    return next((f for f in flags_for(tool) if spelling in f.spellings), None)


def expected(tool: str, spelling: str, values: list[str]) -> str:
    f = entry(tool, spelling)
    if f is None:
        return "accepted"
    if f.kind == REFUSED and not (values and any(_same(values[0], v) for v in f.noop_values)):
        return "refused"
    return "note"


def check_outcome(tool: str, spelling: str, values: list[str], outcome: str, err: str) -> None:
    lines = err.splitlines()
    want = expected(tool, spelling, values)
    about = re.compile(rf"(note|error): {re.escape(spelling)}[ :]")
    if want == "refused":
        assert outcome == "refused" and len(lines) == 1 and about.match(lines[0]) and lines[0].startswith("error"), err
    elif want == "note":
        assert outcome == "loaded" and [line for line in lines if about.match(line)] == lines and len(lines) == 1, err
    else:
        assert outcome in ("loaded", "exit"), err
        assert not any(line.startswith(("error", "note", "warning")) for line in lines), err


def walk(share: Path, readme: str, files: dict[str, str], monkeypatch, capsys) -> tuple[int, list[str]]:
    """(spellings walked, what went wrong with each that did)."""
    tool, values_of = TOOL_OF[readme], accepted_values(files)
    base = ["-m", files["model"], "-t", "1"]
    walked, wrong = 0, []
    for spellings, metavar in readme_rows((share / readme).read_text(encoding="utf-8")):
        for spelling in spellings:
            if spelling in ("-m", "--model", "-t", "--threads"):
                continue
            values = values_of.get(spelling, generic_values(metavar)) if entry(tool, spelling) is None \
                else generic_values(metavar)
            outcome, err = run_tool(tool, [*base, spelling, *values], monkeypatch, capsys)
            try:
                check_outcome(tool, spelling, values, outcome, err)
            except AssertionError as exc:
                wrong.append(f"{tool} {spelling} {' '.join(values)}: {outcome}: {str(exc).splitlines()[0]}")
            walked += 1
    return walked, wrong


@pytest.mark.parametrize("readme", READMES)
def test_every_readme_flag_is_accepted_ignored_or_refused_by_name(readme, files, monkeypatch, capsys):
    walked, wrong = walk(llama_share(), readme, files, monkeypatch, capsys)
    assert not wrong, "\n".join(wrong)
    assert walked > 100  # the tables were found and read


@pytest.mark.parametrize("tool", [CLI, SERVER])
def test_every_table_entry_and_noop_value_on_its_tools(tool):
    parser = MAIN[tool].build_parser()
    for f in flags_for(tool):
        for spelling in f.spellings:
            value = [] if f.nargs == 0 else ["1", "2"] if f.nargs == 2 else ["7"]
            argv = ["-m", "m.gguf", spelling, *value]
            typed = " ".join([spelling, *value])
            if f.kind == REFUSED:
                with pytest.raises(UsageError, match=f"^{re.escape(f'{typed}: {f.why}')}"):
                    parser.parse_args(argv)
            else:
                assert llama_notes(parser.parse_args(argv)) == [f"note: {typed} is ignored: {f.why}"]
            for v in f.noop_values:
                notes = llama_notes(parser.parse_args(["-m", "m.gguf", spelling, v]))
                assert notes == [f"note: {spelling} {v} is ignored: {f.noop_why}"]


@pytest.mark.parametrize("tool, argv, message", [
    (CLI, ["-xyz", "5"], "unrecognized arguments: -xyz 5"),  # an unknown short flag: never -x with "yz"
    (CLI, ["-n5"], "unrecognized arguments: -n5"),  # llama.cpp glues no value to a flag either
    (CLI, ["--chat-templ", "x"], "unrecognized arguments: --chat-templ x"),  # no abbreviations
    (SERVER, ["--chat-template", "chatml"], "--chat-template chatml: llama.cpp's built-in template names"),
    (CLI, ["-ngl", "99"], "-ngl 99: no GPU backend yet"),
    (SERVER, ["-md", "draft.gguf"], "-md draft.gguf: no speculative decoding here"),
])
def test_a_command_line_is_read_flag_by_flag(tool, argv, message, monkeypatch, capsys, k31pro_tiny_gguf):
    outcome, err = run_tool(tool, ["-m", str(k31pro_tiny_gguf), *argv], monkeypatch, capsys)
    assert outcome == "refused" and err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_a_habitual_llama_command_line_runs_up_to_the_load(monkeypatch, capsys, k31pro_tiny_gguf):
    outcome, err = run_tool(CLI, ["-m", str(k31pro_tiny_gguf), "-ngl", "0", "-fa", "on", "-cmoe", "-co", "-st",
                                  "-sp", "-tb", "1", "-t", "1", "--chat-template", "{{ messages[0]['content'] }}",
                                  "-p", "Hi"], monkeypatch, capsys)
    assert outcome == "loaded", err
    assert [line.split(" is ignored")[0] for line in err.splitlines()] == [
        "note: -ngl 0", "note: -fa on", "note: -cmoe", "note: -co", "note: -tb 1"]


def test_no_table_entry_is_also_a_tool_flag():
    # add_llama_flags registers every entry: argparse refuses a spelling given twice, so building
    # the parsers is the check; and no spelling is in two entries of one tool.
    for tool in (CLI, SERVER):
        MAIN[tool].build_parser()
        spellings = [s for f in flags_for(tool) for s in f.spellings]
        assert len(spellings) == len(set(spellings))
    assert all(f.why and (f.kind != REFUSED or not f.noop_values or f.noop_why) for f in FLAGS)


@pytest.mark.parametrize("tool, page", [(CLI, "docs/run.md"), (SERVER, "docs/server.md")])
def test_the_docs_list_what_the_table_says(tool, page):
    block = docs_block(tool)
    text = (REPO / page).read_text(encoding="utf-8")
    assert block[0] in text and block[-1] in text, f"{page} lacks the markers {block[0]} ... {block[-1]}"
    held = text[text.index(block[0]):text.index(block[-1]) + len(block[-1])]
    assert held == "\n".join(block), f"{page}: the table between the markers should read:\n" + "\n".join(block)
