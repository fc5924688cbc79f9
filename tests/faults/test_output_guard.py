"""Every file a conversion writes is guarded like OUT (gguf_arch/io/output_paths.py): never inside
the model directory, never over an existing file without --overwrite, never through a link, never
two outputs of one run on one path, every name within the filesystem's limits; all checked before
the first byte. Each case runs the converter in a child process: exit code, one `error:` line,
and every file that existed before byte-identical afterwards."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_arch.io.output_paths import manifest_path, partial_path
from tests.fuzz.harness import FUZZ
from tests.support.cli import run_cli
from tests.support.paths import FIXTURES

K3_TINY = FIXTURES / "k3-tiny"
SHARD = "model-00003-of-000016.safetensors"


def _snapshot(*dirs: Path) -> dict[str, bytes | str]:
    """Every entry under `dirs`: a file's bytes, a link's target."""
    found: dict[str, bytes | str] = {}
    for d in dirs:
        for p in sorted(d.rglob("*")):
            if p.is_symlink():
                found[str(p)] = "-> " + os.readlink(p)
            elif p.is_file():
                found[str(p)] = p.read_bytes()
    return found


@pytest.fixture
def model(tmp_path) -> Path:
    return Path(shutil.copytree(K3_TINY, tmp_path / "model"))


@pytest.fixture
def out_dir(tmp_path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


def _refused(code: int, model: Path, out_dir: Path, *args, needles=()) -> None:
    before = _snapshot(model, out_dir)
    run_cli(model, *args, "--quiet", timeout=120).one_error_line(code, *needles)
    assert _snapshot(model, out_dir) == before


@pytest.mark.parametrize("overwrite", [(), ("--overwrite",)], ids=["plain", "overwrite"])
def test_log_json_on_a_shard_is_refused_and_the_shard_kept(model, out_dir, overwrite):
    _refused(2, model, out_dir, out_dir / "o.gguf", "--log-json", model / SHARD, *overwrite,
             needles=("inside the model directory", "--log-json"))


def test_log_json_on_out_is_refused_before_anything_is_written(model, out_dir):
    out = out_dir / "o.gguf"
    _refused(2, model, out_dir, out, "--log-json", out, needles=("both the GGUF and the JSON progress log",))
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("other", ["partial", "manifest"])
def test_log_json_on_a_file_that_comes_with_out(model, out_dir, other):
    out = out_dir / "o.gguf"
    path = partial_path(out) if other == "partial" else manifest_path(out)
    _refused(2, model, out_dir, out, "--log-json", path, needles=("both the GGUF's", "JSON progress log"))


def test_rules_on_the_log_json_path(model, out_dir):
    _refused(2, model, out_dir, out_dir / "o.gguf", "--log-json", out_dir / "x", "--export-quantize-rules",
             out_dir / "x", needles=("JSON progress log", "llama-quantize rules"))


@pytest.mark.parametrize("flag", ["--log-json", "--export-quantize-rules"])
def test_an_existing_side_file_needs_overwrite(model, out_dir, flag):
    side = out_dir / "side.txt"
    side.write_bytes(b"keep me")
    _refused(1, model, out_dir, out_dir / "o.gguf", flag, side, needles=(f"{side}: already exists", "--overwrite"))
    assert not (out_dir / "o.gguf").exists()
    assert run_cli(model, out_dir / "o.gguf", flag, side, "--overwrite", "--quiet").rc == 0
    assert side.read_bytes() != b"keep me"


@pytest.mark.parametrize("flag", ["--log-json", "--export-quantize-rules"])
def test_a_side_file_symlink_is_never_written_through(model, out_dir, flag):
    target = out_dir / "precious.bin"
    target.write_bytes(b"keep me")
    link = out_dir / "side.txt"
    link.symlink_to(target)
    _refused(1, model, out_dir, out_dir / "o.gguf", flag, link, needles=("symbolic link", "--overwrite"))
    assert run_cli(model, out_dir / "o.gguf", flag, link, "--overwrite", "--quiet").rc == 0
    assert not link.is_symlink() and target.read_bytes() == b"keep me"


def test_overwrite_never_writes_into_a_hard_link(model, out_dir):
    """--overwrite replaces the name: another name of the same inode keeps its bytes."""
    other = out_dir / "other.bin"
    other.write_bytes(b"keep me")
    os.link(other, out_dir / "log.jsonl")
    assert run_cli(model, out_dir / "o.gguf", "--log-json", out_dir / "log.jsonl", "--overwrite", "--quiet").rc == 0
    assert other.read_bytes() == b"keep me" and (out_dir / "log.jsonl").read_bytes() != b"keep me"


def test_a_stale_manifest_without_its_gguf_needs_overwrite(model, out_dir):
    out = out_dir / "o.gguf"
    manifest_path(out).write_text("{}")
    _refused(1, model, out_dir, out, needles=(f"{manifest_path(out)}: already exists",))


def test_a_planted_partial_manifest_link_is_never_followed(model, out_dir):
    target = out_dir / "precious.bin"
    target.write_bytes(b"keep me")
    out = out_dir / "o.gguf"
    partial_path(manifest_path(out)).symlink_to(target)
    _refused(1, model, out_dir, out, needles=("exists", "interrupted"))
    assert run_cli(model, out, "--overwrite", "--quiet").rc == 0
    assert target.read_bytes() == b"keep me" and not os.path.lexists(partial_path(manifest_path(out)))


def test_split_part_named_by_log_json_is_refused_before_any_part(model, out_dir):
    out = out_dir / "o.gguf"
    _refused(2, model, out_dir, out, "--split-max-tensors", "200", "--log-json", out_dir / "o-00002-of-00002.gguf",
             "--export-quantize-rules", out_dir / "rules.txt", needles=("part o-00002-of-00002.gguf",))
    assert list(out_dir.iterdir()) == []


def test_an_existing_later_part_is_refused_before_the_first_is_written(model, out_dir):
    out = out_dir / "o.gguf"
    (out_dir / "o-00002-of-00002.gguf").write_bytes(b"keep me")
    _refused(1, model, out_dir, out, "--split-max-tensors", "200", "--export-quantize-rules", out_dir / "rules.txt",
             needles=("o-00002-of-00002.gguf: already exists",))
    assert sorted(p.name for p in out_dir.iterdir()) == ["o-00002-of-00002.gguf"]


@pytest.mark.parametrize("mode", ["--print-tensor-types", "--dry-run"])
def test_listing_modes_guard_the_rules_file(model, out_dir, mode):
    out = () if mode == "--print-tensor-types" else (out_dir / "o.gguf",)
    _refused(2, model, out_dir, *out, mode, "--export-quantize-rules", model / SHARD, "--overwrite",
             needles=("inside the model directory",))


# ---- names that do not fit (class 7) ---------------------------------------------------------

def test_a_name_whose_manifest_would_not_fit_is_refused_up_front(model, out_dir):
    """255 bytes is NAME_MAX: OUT (240 bytes), OUT.partial and OUT.manifest.json fit, OUT.manifest.json.partial does not
    (today a complete GGUF would be left without its manifest); found before any work."""
    out = out_dir / ("k" * 235 + ".gguf")
    _refused(2, model, out_dir, out, needles=("partial manifest", "the filesystem allows 255"))
    assert list(out_dir.iterdir()) == []


def test_a_stem_whose_part_names_would_not_fit_is_refused_up_front(model, out_dir):
    out = out_dir / ("k" * 230 + ".gguf")  # fits alone; "-00001-of-00002.gguf.manifest.json.partial" does not
    _refused(2, model, out_dir, out, "--split-max-tensors", "200", needles=("the filesystem allows 255",))


def test_a_path_longer_than_path_max_is_refused_up_front(model, tmp_path):
    deep = tmp_path
    while len(str(deep)) < 4000:
        deep = deep / ("d" * 200)
    deep.mkdir(parents=True)
    _refused(2, model, tmp_path, deep / ("o" * 100 + ".gguf"), needles=("the system allows",))


# ---- hypothesis: any assignment of the run's outputs to hostile places -----------------------

PLACES = ("fresh", "out", "shard", "existing", "link", "in-model-new", "missing-dir")


def _place(name: str, model: Path, out_dir: Path, i: int) -> Path:
    return {"fresh": out_dir / f"new{i}.txt", "out": out_dir / "o.gguf", "shard": model / SHARD,
            "existing": out_dir / "existing.txt", "link": out_dir / "link.txt",
            "in-model-new": model / f"new{i}.txt", "missing-dir": out_dir / "nope" / "x.txt"}[name]


@settings(FUZZ, max_examples=min(FUZZ.max_examples, 24))  # each example is a conversion in a child process
@given(log=st.sampled_from(PLACES), rules=st.sampled_from(PLACES), overwrite=st.booleans(),
       split=st.booleans())
def test_fuzz_side_outputs_never_destroy_a_file(tmp_path_factory, log, rules, overwrite, split):
    root = tmp_path_factory.mktemp("guard")
    model = Path(shutil.copytree(K3_TINY, root / "model"))
    out_dir = root / "out"
    out_dir.mkdir()
    (out_dir / "existing.txt").write_bytes(b"keep me")
    (root / "precious").write_bytes(b"keep me")
    (out_dir / "link.txt").symlink_to(root / "precious")
    before = _snapshot(model, root)
    args = [model, out_dir / "o.gguf", "--quiet", "--log-json", _place(log, model, out_dir, 0),
            "--export-quantize-rules", _place(rules, model, out_dir, 1)]
    args += ["--overwrite"] * overwrite + ["--split-max-tensors", "200"] * split
    res = run_cli(*args, timeout=120)
    after = _snapshot(model, root)
    assert _snapshot(model) == {k: v for k, v in before.items() if k.startswith(str(model))}
    assert after[str(root / "precious")] == b"keep me"
    if res.rc == 0:
        return
    res.one_error_line(res.rc)
    assert res.rc in (1, 2) and after == before  # refused: before the first byte
