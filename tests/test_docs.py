"""The documentation is checked, not hoped: README.md and every page under docs/.

* every relative link resolves: the file exists, and a `#fragment` names a heading of the target
  as GitHub spells its anchors;
* every console script of setup.cfg has a page (SCRIPT_PAGES), and every option its `--help`
  prints appears on that page, so a new flag lands with its line of documentation;
* every command of a ```console block (a line starting with `$ `) is one the project has;
* headings are unique within a page (their anchors would collide);
* no line is longer than MAX_LINE outside tables and code blocks;
* no source file cites a document that is not in the repository: the research notes the model's
  facts were first written from live outside it, and a clone has only docs/reference/.

Each check is a function that returns what it found wrong, run on the real documents and on a
seeded defect in a temporary file, so that none of them can pass by finding nothing.
"""
from __future__ import annotations

import configparser
import contextlib
import importlib
import io
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import REPO

MAX_LINE = 200
# Console script -> the page that documents it. A script missing here fails
# test_every_console_script_has_a_page: a new tool comes with its page.
SCRIPT_PAGES = {
    "convert-kimi-k3": "docs/convert.md",
    "kimi-k3-synth": "docs/synth.md",
    "kimi-k3-diff": "docs/verify.md",
    "kimi-k3-cli": "docs/run.md",
    "kimi-k3-calibrate": "docs/smaller-ggufs.md",
    "kimi-k3-prune": "docs/smaller-ggufs.md",
    "kimi-k3-quantize": "docs/smaller-ggufs.md",
    "kimi-k3-rpc-server": "docs/rpc.md",
    "kimi-k3-doctor": "docs/bigger-than-ram.md",
    "kimi-k3-encode-images": "docs/images.md",
    "kimi-k3-server": "docs/server.md",
}
# What a ```console line may run besides the console scripts, `python FILE.py` (a file of the
# repository), `bash scripts/X.sh` and `$KIMI_K3_LLAMA_BIN/<a tool the setup builds>`.
PROGRAMS = {"pip", "git"}
PYTHON_MODULES = {"ggml_graph_spec", "pytest", "pip"}  # python -m MODULE
SHELL = {"cd", "echo", "export", "printf", "source", "cat", "head"}  # builtins, and filters after a pipe
PREFIXES = {"sudo", "nice"}  # run the command that follows
SEPARATORS = {"|", "||", "&&", ";"}
# The research notes outside the repository that code once cited, by name or as "contract section N".
OUTSIDE_DOCUMENTS = re.compile(r"k3-spec|k31pro-format|dsa-spec|vision-spec|mission\.md|style-models|contract section")
MD_PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)(?:#([\w-]+))?")
CITING = (".py", ".sh", ".cfg", ".toml", ".json", ".md")
# Pages the code already names and their owner writes next: cited before they exist. Each must
# still be missing (test_pending_pages_are_still_pending), so an entry goes once its page lands.
PENDING_PAGES: set[str] = set()
# Files of llama.cpp's tree that the setup keeps beside its tools (scripts/build_llama_tools.sh's
# LLAMA_FILES): the tests read them there, so naming them is no citation of a missing page.
LLAMA_FILES = set(re.search(r"^LLAMA_FILES=\(([^)]*)\)", (REPO / "scripts" / "build_llama_tools.sh").read_text(),
                            re.M).group(1).split())


def documents(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*(```|~~~)", line)
        if m and (fence is None or m.group(1) == fence):
            fence = None if fence else m.group(1)
        elif fence is None:
            out.append((n, line))
    return out


def console_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every `$ ` line of the ```console blocks; a line ending in a
    backslash continues on the next."""
    out, inside, pending = [], False, None
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            inside = stripped == "```console"
            continue
        if pending is not None:
            pending = (pending[0], pending[1][:-1] + " " + stripped)
        elif inside and stripped.startswith("$ "):
            pending = (n, stripped[2:])
        if pending is not None and not pending[1].endswith("\\"):
            out.append(pending)
            pending = None
    return out


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text, lower-cased, without punctuation, spaces
    turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts as its text
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(text: str) -> list[tuple[int, str]]:
    return [(n, m.group(1).strip()) for n, line in prose_lines(text)
            if (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line))]


def anchors(text: str) -> set[str]:
    """Every anchor of a page, a repeated one numbered as GitHub numbers it (x, x-1, x-2)."""
    seen: dict[str, int] = {}
    out = set()
    for _, heading in headings(text):
        a = anchor(heading)
        out.add(f"{a}-{seen[a]}" if a in seen else a)
        seen[a] = seen.get(a, 0) + 1
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of the inline links and images outside code."""
    out = []
    for n, line in prose_lines(text):
        line = re.sub(r"`[^`]*`", "", line)
        out += [(n, m.group(1)) for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line)]
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for n, target in links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.name}:{n}: {target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
            bad.append(f"{page.name}:{n}: {target}: no heading with that anchor in {dest.name}")
    return bad


def repeated_headings(text: str) -> list[str]:
    seen: dict[str, int] = {}
    bad = []
    for n, heading in headings(text):
        a = anchor(heading)
        if a in seen:
            bad.append(f"line {n}: {heading!r} repeats line {seen[a]}")
        seen.setdefault(a, n)
    return bad


def long_lines(text: str, limit: int = MAX_LINE) -> list[str]:
    return [f"line {n}: {len(line)} characters" for n, line in prose_lines(text)
            if len(line) > limit and not line.lstrip().startswith("|")]


def console_scripts(root: Path = REPO) -> dict[str, str]:
    """setup.cfg's console scripts: name -> "module:function"."""
    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg")
    rows = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict((part.strip() for part in row.split("=", 1)) for row in rows)


def help_text(target: str) -> str:
    """What `SCRIPT --help` prints, run in this process through the script's own entry point."""
    module, function = target.split(":")
    main = getattr(importlib.import_module(module), function)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code in (0, None), f"{target} --help exited with {exit_.value.code}"
    return out.getvalue()


def help_options(text: str) -> set[str]:
    """The option strings of an argparse help text: the invocation lines, indented by two spaces
    (wrapped help text is indented further), without -h/--help."""
    found = set()
    for line in text.splitlines():
        if re.match(r"  -", line):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            found |= set(re.findall(r"(?:^|,\s)(--?\w[\w-]*)", invocation))
    return found - {"-h", "--help"}


def undocumented(options: set[str], page_text: str) -> list[str]:
    return sorted(o for o in options if not re.search(r"(?<![\w-])" + re.escape(o) + r"(?![\w-])", page_text))


def llama_tools(root: Path = REPO) -> set[str]:
    """The llama.cpp tools the setup builds (scripts/build_llama_tools.sh's LLAMA_TOOLS)."""
    m = re.search(r"LLAMA_TOOLS=\(([^)]*)\)", (root / "scripts" / "build_llama_tools.sh").read_text())
    return set(m.group(1).split())


def commands_of(line: str) -> list[list[str]]:
    """The simple commands of a shell line (split at |, ||, && and ;), each from its program on:
    environment assignments and sudo/nice before it dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;")
    lexer.whitespace_split = True
    commands, words = [], []
    for token in list(lexer) + [";"]:
        if token in SEPARATORS:
            while words and (re.match(r"\w+=", words[0]) or words[0] in PREFIXES):
                words.pop(0)
            commands += [words] if words else []
            words = []
        else:
            words.append(token)
    return commands


def known_command(words: list[str], scripts: set[str], root: Path = REPO) -> bool:
    program, args = words[0], words[1:]
    if program in scripts or program in PROGRAMS or program in SHELL:
        return True
    if program == "python" and args:
        return (args[0] == "-m" and args[1:2] and args[1].split(".")[0] in PYTHON_MODULES) \
            or args[0] == "-c" or (args[0].endswith(".py") and (root / args[0]).is_file())
    if program == "bash" and args:
        return args[0].startswith("scripts/") and (root / args[0]).is_file()
    tool = re.fullmatch(r"\$KIMI_K3_LLAMA_BIN/(\S+)", program)
    return bool(tool) and tool.group(1) in llama_tools(root)


def unknown_commands(text: str, scripts: set[str], root: Path = REPO) -> list[str]:
    return [f"line {n}: {' '.join(words)}" for n, line in console_lines(text)
            for words in commands_of(line) if not known_command(words, scripts, root)]


def citing_files(root: Path = REPO) -> list[str]:
    """The files that may cite a document: sources, configuration, data rules and prose; not the
    fixtures' data or the fuzz corpus."""
    try:
        names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(root)) for p in root.rglob("*") if ".venv" not in p.parts]
    return [n for n in names if n.endswith(CITING) and not n.startswith("tests/fuzz/corpus/")
            and not (n.startswith("tests/fixtures/") and not n.endswith(".md"))]


def outside_citations(rel: str, text: str, root: Path = REPO) -> list[str]:
    """Citations in `text` (the file `rel`) of a document the repository does not hold: a research
    note by name, or a `*.md` path that is neither repository-relative nor relative to the file
    (a `#fragment` must then name one of its headings)."""
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        bad += [f"{rel}:{n}: {m.group(0)}" for m in OUTSIDE_DOCUMENTS.finditer(line)]
        # A page's own links are test_every_relative_link_resolves' (and its link texts name pages).
        for m in [] if rel.endswith(".md") else MD_PATH.finditer(line):
            path, fragment = m.group(1), m.group(2)
            found = [p for p in (root / path, (root / rel).parent / path) if p.is_file()]
            if not found and path not in PENDING_PAGES and path not in LLAMA_FILES:
                bad.append(f"{rel}:{n}: {path}: not in the repository")
            elif fragment and fragment not in anchors(found[0].read_text()):
                bad.append(f"{rel}:{n}: {path}#{fragment}: no such heading")
    return bad


# ---- the real documents ------------------------------------------------------------------------

def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", documents(), ids=_rel)
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", documents(), ids=_rel)
def test_headings_are_unique(page):
    assert repeated_headings(page.read_text()) == []


@pytest.mark.parametrize("page", documents(), ids=_rel)
def test_no_long_lines_outside_tables_and_code(page):
    assert long_lines(page.read_text()) == []


@pytest.mark.parametrize("page", documents(), ids=_rel)
def test_console_blocks_run_only_what_the_project_has(page):
    assert unknown_commands(page.read_text(), set(console_scripts())) == []


def test_no_source_file_cites_a_document_outside_the_repository():
    bad = []
    for rel in citing_files():
        if rel != "tests/test_docs.py" and (REPO / rel).is_file():
            bad += outside_citations(rel, (REPO / rel).read_text(errors="replace"))
    assert bad == []


def test_pending_pages_are_still_pending():
    landed = sorted(p for p in PENDING_PAGES if (REPO / p).exists())
    assert landed == [], f"{landed} exist now: remove them from PENDING_PAGES"


def test_every_console_script_has_a_page():
    missing = sorted(set(console_scripts()) - set(SCRIPT_PAGES))
    assert missing == [], f"console scripts without a page in SCRIPT_PAGES: {missing}"
    assert [p for p in SCRIPT_PAGES.values() if not (REPO / p).is_file()] == []


@pytest.mark.parametrize("script", sorted(console_scripts()))
def test_every_help_option_is_on_the_scripts_page(script, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # argparse's layout, whatever the terminal
    options = help_options(help_text(console_scripts()[script]))
    assert options, f"{script} --help lists no option"
    page = SCRIPT_PAGES.get(script)
    assert page is not None, f"{script} has no page in SCRIPT_PAGES"
    assert undocumented(options, (REPO / page).read_text()) == []


# ---- each check on a seeded defect -------------------------------------------------------------

def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Exit codes\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n## `--verify` and more\n\n[ok](other.md#exit-codes) [ok](#--verify-and-more) "
                    "[web](https://example.org/x) `[code](gone.md)`\n[gone](gone.md) [no anchor](other.md#exit-code)\n"
                    "[no local anchor](#nowhere)\n\n```\n[in code](gone.md)\n```\n")
    assert [b.split(": ")[0] for b in broken_links(page)] == ["page.md:6", "page.md:6", "page.md:7"]


def test_github_anchors():
    assert anchor("K3.1-Pro indexer fields") == "k31-pro-indexer-fields"
    assert anchor("llama.cpp's own tools") == "llamacpps-own-tools"
    assert anchor("`--verify`") == "--verify"
    assert anchor("A_log is per head") == "a_log-is-per-head"
    assert anchors("# A\n## A\n## A\n") == {"a", "a-1", "a-2"}


def test_a_repeated_heading_is_found():
    text = "# Page\n\n## Options\n\ntext\n\n```\n## Options\n```\n\n### Options\n"
    assert repeated_headings(text) == ["line 11: 'Options' repeats line 3"]


def test_a_long_line_is_found_outside_tables_and_code():
    long = "x" * (MAX_LINE + 1)
    text = f"# Page\n\n{'y' * MAX_LINE}\n| {long} |\n```\n{long}\n```\n{long}\n"
    assert long_lines(text) == [f"line 8: {MAX_LINE + 1} characters"]


def test_an_unknown_command_in_a_console_block_is_found():
    text = ("```console\n$ kimi-k3-cli -m x.gguf\n$ kimi-k3-clj -m x.gguf\n$ CI=true bash scripts/test.sh\n"
            "$ bash scripts/nothing.sh\n$ printf 'a\\n' | kimi-k3-cli -m x.gguf | cat -v\n$ rm -rf out \\\n"
            "    && ls\n$ python bench/graph.py\n$ python bench/none.py\n$ $KIMI_K3_LLAMA_BIN/llama-cli -m x\n"
            "$ $KIMI_K3_LLAMA_BIN/llama-bench\nprinted output\n```\n\n```\n$ not-checked\n```\n")
    assert unknown_commands(text, {"kimi-k3-cli"}) == [
        "line 3: kimi-k3-clj -m x.gguf", "line 5: bash scripts/nothing.sh", "line 7: rm -rf out",
        "line 7: ls", "line 10: python bench/none.py", "line 12: $KIMI_K3_LLAMA_BIN/llama-bench"]


def test_an_undocumented_option_is_found():
    text = ("usage: tool [-h] [--overwrite] [-t N] [--dry-run]\n\noptions:\n  -h, --help  show help\n"
            "  --overwrite           replace OUT\n  -t N, --threads N     threads, -1 =\n"
            "                        -x: not an option\n  --dry-run\n                        plan only\n")
    options = help_options(text)
    assert options == {"--overwrite", "-t", "--threads", "--dry-run"}
    page = "| `-t/--threads N` | threads |\n| `--dry-run-all` | a longer option |\n"
    assert undocumented(options, page) == ["--dry-run", "--overwrite"]


def test_a_citation_outside_the_repository_is_found(tmp_path):
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    (tmp_path / "docs" / "reference" / "dsa.md").write_text("# DSA\n\n## Indexer math\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "notes.md").write_text("# Notes\n")
    text = ('"""Top-k (docs/reference/dsa.md#indexer-math; notes.md), see README.md."""\n'
            "# the indexer (k31pro-format.md section 3, dsa-spec B.2) and (contract section 5)\n"
            "# docs/reference/dsa.md#selection, findings.md, docs/reference/gone.md\n")
    assert outside_citations("pkg/mod.py", text, tmp_path) == [
        "pkg/mod.py:1: README.md: not in the repository", "pkg/mod.py:2: k31pro-format",
        "pkg/mod.py:2: dsa-spec", "pkg/mod.py:2: contract section",
        "pkg/mod.py:2: k31pro-format.md: not in the repository",
        "pkg/mod.py:3: docs/reference/dsa.md#selection: no such heading",
        "pkg/mod.py:3: findings.md: not in the repository",
        "pkg/mod.py:3: docs/reference/gone.md: not in the repository"]
    assert outside_citations("pkg/notes.md", "see `dsa-spec.md` B.2 and [x](gone.md)\n", tmp_path) == [
        "pkg/notes.md:1: dsa-spec"]


def test_a_console_script_without_a_page_is_found(tmp_path):
    (tmp_path / "setup.cfg").write_text("[options.entry_points]\nconsole_scripts =\n"
                                        "    convert-kimi-k3 = convert_kimi_k3:main\n    kimi-k3-new = x.y:main\n")
    assert sorted(set(console_scripts(tmp_path)) - set(SCRIPT_PAGES)) == ["kimi-k3-new"]


def test_the_checks_read_the_documents():
    pages = documents()
    assert REPO / "README.md" in pages and all(REPO / p in pages for p in SCRIPT_PAGES.values())
    readme = (REPO / "README.md").read_text()
    assert len(links(readme)) > 10 and len(console_lines(readme)) > 5 and len(headings(readme)) > 10
