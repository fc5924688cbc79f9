"""The mmproj: the vision tower and projector written as llama.cpp's clip GGUF, byte for byte the
checkpoint's, with the text GGUF's manifest, verification, diff, split, dry run and type rules."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGUFReader

import convert_kimi_k3
from gguf_arch.arch.mmproj import MMPROJ_KEYS, plan_vision_tensors, vision_config_from_metadata
from gguf_arch.arch.vision import VIT_NORM_EPS, load_vision_config
from gguf_arch.verify.diff import diff_gguf
from gguf_arch.verify.verify import verify

from tests.support.checkpoint_edit import EditableCheckpoint, source_array
from tests.support.cli import run_cli, run_tool

VISION_SOURCES = ("vision_tower.", "mm_projector.")


def _meta(reader: GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _convert(*args, capsys=None) -> int:
    rc = convert_kimi_k3.main([*map(str, args), "--quiet"])
    return rc


def test_every_tensor_is_the_checkpoints_bytes(k31pro_tiny_dir, k31pro_tiny_mmproj):
    """Read with gguf-py and the fixture's raw shard bytes: the BF16 matrices bit for bit, the norm
    gains widened to F32 (the high half of each F32 is the BF16, the low half zero)."""
    reader = GGUFReader(k31pro_tiny_mmproj)
    index = json.loads((k31pro_tiny_dir / "model.safetensors.index.json").read_text())["weight_map"]
    vision = sorted(n for n in index if n.startswith(VISION_SOURCES))
    seen = []
    for t in reader.tensors:
        plan = next(p for p in plan_vision_tensors(load_vision_config(k31pro_tiny_dir)[0]) if p.name == t.name)
        source = plan.sources[0][0]
        dtype, src = source_array(k31pro_tiny_dir, source)
        assert dtype == "BF16"
        data = np.asarray(t.data)
        if t.tensor_type.name == "BF16":
            assert data.view(np.uint16).tobytes() == src.tobytes(), t.name
        else:
            assert t.tensor_type.name == "F32" and src.ndim == 1, t.name
            bits = data.view(np.uint32)
            assert np.array_equal(bits >> 16, src.astype(np.uint32)) and not (bits & 0xFFFF).any(), t.name
        assert tuple(reversed([int(d) for d in t.shape]))[:src.ndim] == src.shape
        seen.append(source)
    assert sorted(seen) == vision  # every vision tensor of the checkpoint, each once


def test_keys_are_the_clip_convention_and_read_back(k31pro_tiny_dir, k31pro_tiny_mmproj):
    meta = _meta(GGUFReader(k31pro_tiny_mmproj))
    raw = json.loads((k31pro_tiny_dir / "config.json").read_text())
    v = raw["vision_config"]
    assert meta["general.architecture"] == "clip" and meta["general.type"] == "mmproj"
    assert meta["clip.projector_type"] == "kimik3" and meta["clip.has_vision_encoder"] is True
    assert (meta["clip.vision.patch_size"], meta["clip.vision.embedding_length"], meta["clip.vision.block_count"],
            meta["clip.vision.attention.head_count"], meta["clip.vision.feed_forward_length"],
            meta["clip.vision.projection_dim"], meta["clip.vision.projector.scale_factor"]) == (
        v["patch_size"], v["vt_hidden_size"], v["vt_num_hidden_layers"], v["vt_num_attention_heads"],
        v["vt_intermediate_size"], raw["text_config"]["hidden_size"], v["merge_kernel_size"][0])
    assert meta["clip.vision.attention.layer_norm_epsilon"] == np.float32(np.finfo(np.float32).eps)
    assert meta["clip.vision.kimik3.projector.layer_norm_epsilon"] == np.float32(v["projector_ln_eps"])
    assert meta["clip.vision.kimik3.media_placeholder_token_id"] == raw["media_placeholder_token_id"]
    assert meta["clip.vision.image_mean"] == meta["clip.vision.image_std"] == [0.5, 0.5, 0.5]
    assert meta["clip.vision.image_max_pixels"] == 65536 * v["patch_size"] ** 2
    assert {k.name for k in MMPROJ_KEYS} <= set(meta)
    want = load_vision_config(k31pro_tiny_dir)[0]  # its eps as the float32 key holds it
    assert vision_config_from_metadata(meta, "m") == replace(want, projector_eps=float(np.float32(want.projector_eps)))
    assert VIT_NORM_EPS == float(np.float32(1.1920929e-07))


def test_the_two_fixtures_towers_are_the_same_bytes(tmp_path, k3_tiny_dir, k31pro_tiny_mmproj):
    """The vision weights are bitwise identical in k3-tiny and k31pro-tiny, so are their mmprojs' tensors."""
    out = tmp_path / "k3.gguf"
    assert _convert(k3_tiny_dir, "--mmproj", out, "--mmproj-only") == 0
    a, b = GGUFReader(out), GGUFReader(k31pro_tiny_mmproj)
    assert [(t.name, np.asarray(t.data).tobytes()) for t in a.tensors] == \
        [(t.name, np.asarray(t.data).tobytes()) for t in b.tensors]


def test_text_and_mmproj_in_one_run(tmp_path, k31pro_tiny_dir, k31pro_tiny_gguf, k31pro_tiny_mmproj):
    """With --mmproj the text GGUF is the same file as without it, the mmproj the same as --mmproj-only."""
    text, mm = tmp_path / "m.gguf", tmp_path / "mm.gguf"
    assert _convert(k31pro_tiny_dir, text, "--mmproj", mm) == 0
    assert text.read_bytes() == k31pro_tiny_gguf.read_bytes()
    assert mm.read_bytes() == k31pro_tiny_mmproj.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.gguf.manifest.json", "mm.gguf",
                                                          "mm.gguf.manifest.json"]


def test_resume_keeps_a_finished_mmproj(tmp_path, k31pro_tiny_dir, capsys):
    mm = tmp_path / "mm.gguf"
    assert _convert(k31pro_tiny_dir, tmp_path / "m.gguf", "--mmproj", mm) == 0
    before = mm.stat().st_mtime_ns
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), str(tmp_path / "m.gguf"), "--mmproj", str(mm), "--resume"]) == 0
    assert f"{mm}: finished earlier, verified against mm.gguf.manifest.json; kept" in capsys.readouterr().out
    assert mm.stat().st_mtime_ns == before


def test_diff_and_verify_cover_the_mmproj(tmp_path, k31pro_tiny_dir, k31pro_tiny_mmproj):
    report = diff_gguf(k31pro_tiny_dir, k31pro_tiny_mmproj)
    assert report.ok and report.counts()["exact"] == len(report.tensors) == 18
    verify(k31pro_tiny_mmproj, k31pro_tiny_dir, log=lambda _m: None)
    # One value of one block changed (and the manifest re-made so that only the diff can see it).
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(k31pro_tiny_mmproj.read_bytes())
    t = next(t for t in GGUFReader(bad).tensors if t.name == "v.blk.1.ffn_down.weight")
    with open(bad, "r+b") as f:
        f.seek(int(t.data_offset) + 2 * 7)
        f.write(b"\x80\x3f")  # bf16 1.0
    diff = run_tool("diff", k31pro_tiny_dir, bad)
    assert diff.rc == 1 and "v.blk.1.ffn_down.weight  MISMATCH" in diff.out
    verified = run_cli("--verify", bad, k31pro_tiny_dir)
    assert verified.rc == 1 and "bad.gguf.manifest.json" in verified.err  # no manifest for the copy


def test_text_options_never_touch_the_mmproj(tmp_path, k31pro_tiny_dir, k31pro_tiny_mmproj):
    mm = tmp_path / "mm.gguf"
    assert _convert(k31pro_tiny_dir, tmp_path / "m.gguf", "--mmproj", mm, "--outtype", "q8_0",
                    "--tensor-type", ".*=f16", "--tensor-type", "ffn_up=q8_0") == 0
    assert mm.read_bytes() == k31pro_tiny_mmproj.read_bytes()


def test_mmproj_tensor_types_are_named_rules_and_norms_stay_f32(tmp_path, k31pro_tiny_dir, capsys):
    mm = tmp_path / "mm.gguf"
    rc = convert_kimi_k3.main([str(k31pro_tiny_dir), "--mmproj", str(mm), "--mmproj-only",
                               "--mmproj-tensor-type", "ffn_up=q8_0", "--mmproj-tensor-type", ".*=f16"])
    out = capsys.readouterr().out
    assert rc == 0
    types = {t.name: t.tensor_type.name for t in GGUFReader(mm).tensors}
    assert types["v.blk.0.ffn_up.weight"] == types["v.blk.1.ffn_up.weight"] == "Q8_0"
    assert types["v.blk.0.attn_qkv.weight"] == "F16"
    norms = [n for n in types if n.endswith(("ln1.weight", "ln2.weight", "post_ln.weight", "post_norm.weight"))]
    assert len(norms) == 6 and {types[n] for n in norms} == {"F32"}
    assert "--mmproj-tensor-type .*=f16: left 6 protected tensor(s) alone" in out
    report = diff_gguf(k31pro_tiny_dir, mm)
    assert report.ok and report.counts()["within_bound"] == 12


def test_split_mmproj_verifies_and_diffs(tmp_path, k31pro_tiny_dir, k31pro_tiny_mmproj):
    mm = tmp_path / "mm.gguf"
    assert _convert(k31pro_tiny_dir, "--mmproj", mm, "--mmproj-only", "--split-max-tensors", "5") == 0
    parts = sorted(p.name for p in tmp_path.glob("mm-*-of-*.gguf"))
    assert parts == [f"mm-0000{i}-of-00004.gguf" for i in range(1, 5)]
    first = tmp_path / parts[0]
    verify(first, k31pro_tiny_dir, log=lambda _m: None)
    assert diff_gguf(k31pro_tiny_dir, first).ok
    joined = [np.asarray(t.data).tobytes() for p in parts for t in GGUFReader(tmp_path / p).tensors]
    assert joined == [np.asarray(t.data).tobytes() for t in GGUFReader(k31pro_tiny_mmproj).tensors]


def test_dry_run_lists_the_mmproj_with_its_exact_size(tmp_path, k31pro_tiny_dir, k31pro_tiny_mmproj, capsys):
    mm = tmp_path / "mm.gguf"
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), str(tmp_path / "m.gguf"), "--mmproj", str(mm),
                                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"file {mm}: 18 tensors, {k31pro_tiny_mmproj.stat().st_size} bytes" in out
    assert "total: 2 file(s), 387 tensors" in out
    assert list(tmp_path.iterdir()) == []


def test_print_tensor_types_lists_the_mmproj(k31pro_tiny_dir, capsys):
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), "--print-tensor-types", "--mmproj", "mm.gguf", "--mmproj-only",
                                 "--mmproj-tensor-type", "ffn_up=q8_0"]) == 0
    out = capsys.readouterr().out
    assert "v.blk.1.ffn_up.weight" in out and "--mmproj-tensor-type ffn_up=q8_0" in out
    assert "blk.0.attn_norm.weight" not in out  # no text model listed with --mmproj-only
    assert "18 tensors" in out.splitlines()[-1]


@pytest.mark.parametrize("args, needle", [
    (("OUT", "--mmproj", "OUT"), "both the GGUF and the mmproj of this run would be written there"),
    (("--mmproj-only",), "--mmproj-only need(s) --mmproj"),
    (("OUT", "--mmproj-tensor-type", "ffn_up=q8_0"), "--mmproj-tensor-type need(s) --mmproj"),
    (("OUT", "--mmproj", "MM", "--mmproj-only"), "--mmproj-only writes no text GGUF; OUT would be ignored"),
    (("--mmproj", "MM", "--mmproj-only", "--no-dsa", "--outtype", "q8_0"), "--no-dsa, --outtype would be ignored"),
    (("--mmproj", "MM", "--mmproj-only", "--mmproj-tensor-type", "nope"), "--mmproj-tensor-type: malformed rule"),
])
def test_misused_options_one_line_nothing_written(tmp_path, k31pro_tiny_dir, args, needle):
    names = {"OUT": str(tmp_path / "a.gguf"), "MM": str(tmp_path / "mm.gguf")}
    run_cli(k31pro_tiny_dir, *(names.get(a, a) for a in args)).one_error_line(2, needle)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def pro(tmp_path, k31pro_tiny_dir) -> EditableCheckpoint:
    return EditableCheckpoint(k31pro_tiny_dir, tmp_path / "model")


def _bad_vision(pro: EditableCheckpoint, tmp_path, *needles: str) -> None:
    """Neither output is written: the mmproj is planned with the text GGUF, before either."""
    out = tmp_path / "out"
    out.mkdir()
    run_cli(pro.dir, out / "m.gguf", "--mmproj", out / "mm.gguf").one_error_line(2, *needles)
    assert list(out.iterdir()) == []


def test_an_unexpected_bias_is_refused(pro, tmp_path):
    name = "vision_tower.encoder.blocks.0.wqkv.bias"
    pro.add(name, "BF16", [96], bytes(192), "model-00016-of-000016.safetensors")
    _bad_vision(pro, tmp_path, f"unknown tensor {name}", "vision table")


def test_a_misshaped_tower_tensor_is_refused(pro, tmp_path):
    name = "vision_tower.encoder.blocks.1.mlp.fc0.weight"
    pro.replace(name, "BF16", [32, 64], bytes(4096))
    _bad_vision(pro, tmp_path, name, "shape [32, 64], expected [64, 32]", "v.blk.1.ffn_up.weight")


def test_a_missing_projector_tensor_is_refused(pro, tmp_path):
    pro.drop("mm_projector.post_norm.weight")
    _bad_vision(pro, tmp_path, "missing tensor mm_projector.post_norm.weight", "mm.post_norm.weight")


@pytest.mark.parametrize("edit, needles", [
    (lambda v: v.__setitem__("merge_type", "sd2_pool"), ("vision_config.merge_type must be 'sd2_tpool'",)),
    (lambda v: v.__setitem__("pos_emb_interpolation_mode", "bicubic"), ("pos_emb_interpolation_mode",)),
    (lambda v: v.__setitem__("norm_type", "layernorm"), ("vision_config.norm_type must be 'rmsnorm'",)),
    (lambda v: v.__setitem__("mm_hidden_size", 16), ("mm_hidden_size (16) must equal vt_hidden_size (32)",)),
    (lambda v: v.__setitem__("text_hidden_size", 32), ("text_hidden_size (32) must equal text_config.hidden_size",)),
    (lambda v: v.__setitem__("vt_num_attention_heads", 3), ("qkv_hidden_size (32) must be",)),
    (lambda v: v.__setitem__("merge_kernel_size", [2, 1]), ("merge_kernel_size must be [k, k]",)),
    (lambda v: v.pop("patch_size"), ("missing required field(s): vision_config.patch_size",)),
])
def test_vision_config_problems_are_refused(pro, tmp_path, edit, needles):
    pro.edit_config(lambda c: edit(c["vision_config"]))
    _bad_vision(pro, tmp_path, "config.json", *needles)


def test_preprocessor_config_is_read_and_checked(pro, tmp_path, k31pro_tiny_mmproj):
    media = {"patch_size": 4, "merge_kernel_size": 2, "in_patch_limit": 1024, "patch_limit_on_one_side": 64,
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fixed_output_tokens": None}
    (pro.dir / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": media}))
    out = tmp_path / "mm.gguf"
    assert _convert(pro.dir, "--mmproj", out, "--mmproj-only") == 0
    meta = _meta(GGUFReader(out))
    assert meta["clip.vision.image_max_pixels"] == 1024 * 16
    assert meta["clip.vision.kimik3.patch_limit_on_one_side"] == 64
    assert meta["clip.vision.kimik3.background.pattern"] == "none"  # no transparent_bg_config: alpha dropped
    media["patch_size"] = 14
    (pro.dir / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": media}))
    _bad_vision(pro, tmp_path, "media_proc_cfg.patch_size is 14, the tower's (vision_config.) is 4")
