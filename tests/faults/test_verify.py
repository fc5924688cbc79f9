"""Integrity: the <out>.manifest.json manifest and `convert_kimi_k3.py --verify OUT.gguf MODEL_DIR`.

A clean conversion verifies; any changed byte (tensor data or header), a truncated or replaced
file, a missing or damaged manifest, or a GGUF that agrees with its manifest but not with the
checkpoint fails with exit 1 and one line naming the first difference.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import blake3
import pytest
from gguf import GGUFReader

import convert_kimi_k3
from gguf_arch.io.manifest import MANIFEST_FORMAT, manifest_path, read_manifest
from gguf_arch.synth.cli import plan_checkpoint, write_checkpoint
from gguf_arch.synth.config import PRESETS

from tests.support.cli import peak_rss_kib, run_cli
from tests.support.manifests import write_legacy_manifest
from tests.support.paths import FIXTURES

PRO = FIXTURES / "k31pro-tiny"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "pro.gguf"
    assert convert_kimi_k3.main([str(PRO), str(out), "--quiet"]) == 0
    return out


def _copy(src: Path, dst_dir: Path, name: str = "m.gguf") -> Path:
    dst = dst_dir / name
    shutil.copyfile(src, dst)
    shutil.copyfile(manifest_path(src), manifest_path(dst))
    return dst


def _flip(gguf: Path, name: str, byte: int, mask: int) -> None:
    reader = GGUFReader(gguf, "r+")
    t = next(t for t in reader.tensors if t.name == name)
    reader.data[t.data_offset + byte] ^= mask
    reader.data.flush()


def _verify(capsys, gguf: Path, model: Path = PRO) -> tuple[int, str, str]:
    rc = convert_kimi_k3.main(["--verify", str(gguf), str(model)])
    out, err = capsys.readouterr()
    return rc, out, err


def _fails(capsys, gguf: Path, *needles: str, model: Path = PRO, code: int = 1) -> str:
    rc, _, err = _verify(capsys, gguf, model)
    assert rc == code, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_manifest_lists_every_tensor_in_file_order_with_its_digest(converted):
    m = read_manifest(converted)
    reader = GGUFReader(converted)
    assert [(d.name, d.ggml_type, d.nbytes) for d in m.tensors] == \
        [(t.name, t.tensor_type.name, int(t.n_bytes)) for t in reader.tensors]
    for d, t in zip(m.tensors, reader.tensors):
        assert d.digest == blake3.blake3(t.data.tobytes()).hexdigest()
    assert m.gguf_size == converted.stat().st_size
    start = min(t.data_offset for t in reader.tensors)
    assert m.header == blake3.blake3(converted.read_bytes()[:start]).hexdigest()
    doc = json.loads(manifest_path(converted).read_text())
    assert (doc["format"], doc["version"], doc["hash"]) == (MANIFEST_FORMAT, 2, "blake3")
    assert manifest_path(converted).name == "pro.gguf.manifest.json"


def test_a_clean_conversion_verifies(converted, capsys):
    rc, out, err = _verify(capsys, converted)
    assert rc == 0 and err == "", err
    assert f"all {len(read_manifest(converted).tensors)} tensors match" in out


def test_the_command_line_as_documented(converted):
    assert run_cli("--verify", converted, PRO, "--quiet").rc == 0
    res = run_cli("--verify", converted, PRO, converted)
    assert res.rc == 2 and "--verify takes OUT.gguf MODEL_DIR" in res.err


def _blake3_copy(converted: Path, tmp_path: Path) -> Path:
    return _copy(converted, tmp_path)


def _sha256_copy(converted: Path, tmp_path: Path) -> Path:
    """The GGUF with only the manifest an earlier converter wrote for it (SHA-256, version 1)."""
    gguf = tmp_path / "old.gguf"
    shutil.copyfile(converted, gguf)
    write_legacy_manifest(gguf)
    return gguf


MANIFESTS = pytest.mark.parametrize("copy, hash_name", [(_blake3_copy, "BLAKE3"), (_sha256_copy, "SHA256")],
                                    ids=["blake3", "sha256-v1"])


@MANIFESTS
def test_one_flipped_bit_in_a_tensor(converted, tmp_path, capsys, copy, hash_name):
    gguf = copy(converted, tmp_path)
    _flip(gguf, "blk.5.ffn_down_exps.weight", 1000, 1)
    _fails(capsys, gguf, f"tensor blk.5.ffn_down_exps.weight: {hash_name} digest differs")


@MANIFESTS
def test_a_changed_metadata_byte(converted, tmp_path, capsys, copy, hash_name):
    gguf = copy(converted, tmp_path)
    reader = GGUFReader(gguf, "r+")
    part = reader.fields["general.name"].parts[-1]  # the string's bytes
    part[0] ^= 0x20
    reader.data.flush()
    _fails(capsys, gguf, "header (metadata or tensor infos) differs")


def test_truncated_gguf(converted, tmp_path, capsys):
    gguf = _copy(converted, tmp_path)
    gguf.write_bytes(gguf.read_bytes()[:-4096])
    _fails(capsys, gguf, "the manifest says", "truncated or replaced")


def test_missing_gguf(tmp_path, capsys):
    _fails(capsys, tmp_path / "absent.gguf", "absent.gguf: not found", code=2)


def test_missing_manifest(converted, tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    shutil.copyfile(converted, gguf)
    _fails(capsys, gguf, "no integrity manifest")


@pytest.mark.parametrize("damage", [
    lambda doc: "{not json",
    lambda doc: json.dumps({**doc, "format": "other/1"}),
    lambda doc: json.dumps({**doc, "tensors": doc["tensors"][:-1]}),
    lambda doc: json.dumps({**doc, "tensors": [[*doc["tensors"][0][:3], "z" * 64], *doc["tensors"][1:]]}),
    lambda doc: json.dumps({**doc, "tensors": [["x\n", "NOPE", -1, ""]]}),
    lambda doc: "[" * 100_000 + "]" * 100_000,
], ids=["not-json", "format", "one-tensor-short", "bad-digest", "bad-row", "deep"])
def test_damaged_manifest(converted, tmp_path, capsys, damage):
    gguf = _copy(converted, tmp_path)
    doc = json.loads(manifest_path(gguf).read_text())
    manifest_path(gguf).write_text(damage(doc))
    _fails(capsys, gguf)


def test_consistent_with_its_manifest_but_not_with_the_checkpoint(converted, tmp_path, capsys):
    """Rehashed after tampering (or converted by a buggy converter): the source diff catches it."""
    gguf = _copy(converted, tmp_path)
    name = "blk.0.attn_norm.weight"
    _flip(gguf, name, 1, 0x40)  # a mantissa bit of the first value
    doc = json.loads(manifest_path(gguf).read_text())
    t = next(t for t in GGUFReader(gguf).tensors if t.name == name)
    for row in doc["tensors"]:
        if row[0] == name:
            row[3] = blake3.blake3(t.data.tobytes()).hexdigest()
    manifest_path(gguf).write_text(json.dumps(doc))
    _fails(capsys, gguf, f"differs from {PRO}", name, "MISMATCH")


def test_another_checkpoint(converted, capsys):
    _fails(capsys, converted, model=FIXTURES / "k3-tiny")


def test_index_pointing_outside_the_model_dir_is_refused_before_any_read(converted, tmp_path, capsys):
    model = Path(shutil.copytree(PRO, tmp_path / "model"))
    index = model / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first = next(iter(doc["weight_map"]))
    doc["weight_map"][first] = "../outside.safetensors"
    index.write_text(json.dumps(doc))
    _fails(capsys, converted, "not a plain file name inside the model directory", model=model, code=2)


def _verify_peak_rss_kb(tmp_path: Path, experts: int) -> tuple[int, int]:
    """(GGUF bytes, peak RSS in KiB of --verify in a fresh interpreter) for a synthetic K3.1-Pro."""
    dims = dict(PRESETS["tiny"], layers=4, hidden=1024, intermediate=2048, experts=experts, **{
        "moe-intermediate": 1024, "latent": 1024, "kda-heads": 8, "kda-head-dim": 128, "mla-heads": 8,
        "q-lora": 256, "kv-lora": 128, "qk-nope": 64, "qk-rope": 32, "v-head-dim": 64,
        "index-heads": 8, "index-head-dim": 64})
    model, out = tmp_path / f"model{experts}", tmp_path / f"big{experts}.gguf"
    write_checkpoint(plan_checkpoint(dims, "k31pro", seed=1), model)
    assert convert_kimi_k3.main([str(model), str(out), "--quiet"]) == 0
    return out.stat().st_size, peak_rss_kib("--verify", out, model, "--quiet")


def test_verify_memory_does_not_grow_with_the_model(tmp_path):
    """--verify of a ~250 MB and a ~120 MB checkpoint: about the same peak RSS (measured 81 MiB
    for both when run alone, up to 200 MiB after the fuzz suite in the same pytest run, 592 MiB for
    the large one before the diff dropped the pages it had read)."""
    small_size, small_rss = _verify_peak_rss_kb(tmp_path, experts=4)
    big_size, big_rss = _verify_peak_rss_kb(tmp_path, experts=32)
    assert big_size > 200 * 2 ** 20 and big_size > 2 * small_size
    assert big_rss < 256 * 1024, big_rss
    assert big_rss - small_rss < 64 * 1024, (small_rss, big_rss)


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> list[Path]:
    """k31pro-tiny converted into parts of at most 100 tensors: the parts, first to last."""
    out = tmp_path_factory.mktemp("split") / "pro.gguf"
    assert convert_kimi_k3.main([str(PRO), str(out), "--quiet", "--split-max-tensors", "100"]) == 0
    parts = sorted(out.parent.glob("pro-*-of-*.gguf"))
    assert len(parts) == 4
    return parts


def _split_copy(parts: list[Path], tmp_path: Path) -> list[Path]:
    return [_copy(p, tmp_path, p.name) for p in parts]


def test_a_split_conversion_verifies_from_its_first_part(split, capsys):
    rc, out, err = _verify(capsys, split[0])
    assert rc == 0 and err == "", err
    assert "manifest(s) of 4 file(s)" in out and "all 369 tensors match" in out


def test_a_flipped_bit_in_a_later_part(split, tmp_path, capsys):
    parts = _split_copy(split, tmp_path)
    name = GGUFReader(parts[2]).tensors[0].name
    _flip(parts[2], name, 0, 1)
    _fails(capsys, parts[0], f"{parts[2]}: tensor {name}: BLAKE3 digest differs")


def test_a_missing_part_or_part_manifest(split, tmp_path, capsys):
    parts = _split_copy(split, tmp_path)
    manifest_path(parts[1]).unlink()
    _fails(capsys, parts[0], "no integrity manifest", parts[1].name)
    parts[3].unlink()
    manifest_path(parts[1]).write_bytes(manifest_path(split[1]).read_bytes())
    _fails(capsys, parts[0], f"{parts[3]}: not found (a part of the split", code=2)


def test_a_later_part_is_not_a_starting_point(split, capsys):
    _fails(capsys, split[1], "give the first part", code=2)


# ---- manifests written before BLAKE3 (version 1: SHA-256, <file>.sha256.json) ----------------

def test_a_gguf_with_a_sha256_manifest_verifies(converted, tmp_path, capsys):
    """The output bytes did not change with the hash: a SHA-256 manifest made from today's GGUF
    by hashlib alone matches what the verifier recomputes."""
    gguf = _sha256_copy(converted, tmp_path)
    m = read_manifest(gguf)
    assert m.hash == "sha256" and len(m.tensors) == len(read_manifest(converted).tensors)
    rc, out, err = _verify(capsys, gguf)
    assert rc == 0 and err == "", err
    assert f"all {len(m.tensors)} tensors match" in out


def test_the_blake3_manifest_is_read_when_both_are_there(converted, tmp_path, capsys):
    """A stale version-1 manifest beside a current one is not what decides."""
    gguf = _copy(converted, tmp_path)
    legacy = write_legacy_manifest(gguf)
    doc = json.loads(legacy.read_text())
    doc["tensors"][0][3] = "0" * 64
    legacy.write_text(json.dumps(doc))
    assert read_manifest(gguf).hash == "blake3"
    assert _verify(capsys, gguf)[0] == 0


@pytest.mark.parametrize("damage, needle", [
    (lambda doc: {**doc, "header_sha256": "z" * 64}, "not a complete sha256 manifest"),
    (lambda doc: {**doc, "format": "kimi-k3-gguf-sha256/9"}, "not a kimi-k3-gguf-manifest manifest"),
    (lambda doc: {**doc, "tensors": [[*doc["tensors"][0][:3], "0" * 64], *doc["tensors"][1:]]}, "SHA256 digest differs"),
], ids=["bad-header-digest", "unknown-format", "wrong-digest"])
def test_a_damaged_sha256_manifest(converted, tmp_path, capsys, damage, needle):
    gguf = _sha256_copy(converted, tmp_path)
    legacy = gguf.with_name(gguf.name + ".sha256.json")
    legacy.write_text(json.dumps(damage(json.loads(legacy.read_text()))))
    _fails(capsys, gguf, needle)


@pytest.mark.parametrize("doc", [{"version": 3}, {"hash": "sha256"}, {"version": None}], ids=["v3", "v2-sha256", "no-version"])
def test_a_manifest_of_an_unknown_version_is_refused(converted, tmp_path, capsys, doc):
    gguf = _copy(converted, tmp_path)
    manifest_path(gguf).write_text(json.dumps({**json.loads(manifest_path(gguf).read_text()), **doc}))
    _fails(capsys, gguf, "this version reads version 2 (blake3) and 1 (sha256)")
