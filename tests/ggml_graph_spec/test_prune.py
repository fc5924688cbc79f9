"""kimi-k3-prune: what survives is bit-exact, what it records lets --verify and kimi-k3-diff check
a pruned GGUF against the checkpoint, and pruning experts a text never reaches leaves its logits.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf import GGUFValueType as T

import convert_kimi_k3
from gguf_arch.arch import keys as K
from gguf_arch.arch.pruned import is_per_expert
from gguf_arch.io.manifest import check_hashes, read_manifest
from gguf_arch.io.saliency import LayerSaliency
from gguf_arch.verify.diff import main as diff_main
from ggml_graph_spec.tools import prune
from ggml_graph_spec.tools.calibrate import main as calibrate
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.tools.prune import main, top_experts
from ggml_graph_spec.text.tokenizer import BPETokenizer
from tests.support.gguf_edit import rewritten_copy
from tests.support.paths import K31PRO_TINY, PROSE

MOE_LAYERS = range(1, 13)  # k31pro-tiny: 13 layers, the first dense; 8 experts, top 2


def _plan(tmp_path: Path, kept: dict[int, list[int]], name: str = "plan.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"layers": {str(l): ids for l, ids in kept.items()}}))
    return path


def _pattern(n: int) -> dict[int, list[int]]:
    """A different choice of n experts per layer."""
    return {l: sorted((l + 3 * i) % 8 for i in range(n)) for l in MOE_LAYERS}


def _fields(path: Path) -> dict:
    return {k: f.contents() for k, f in GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


def _pruned(src: Path, tmp_path: Path, kept: dict[int, list[int]], name: str = "pruned.gguf") -> Path:
    out = tmp_path / name
    assert main([str(src), str(out), "--plan", str(_plan(tmp_path, kept, name + ".plan.json")), "--quiet"]) == 0
    return out


@pytest.mark.parametrize("n", [5, 1])
def test_kept_experts_are_bit_exact_and_everything_else_is_copied(k31pro_tiny_gguf, tmp_path, n):
    kept = _pattern(n)
    out = _pruned(k31pro_tiny_gguf, tmp_path, kept)
    a, b = GGUFReader(k31pro_tiny_gguf), GGUFReader(out)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.tensor_type == tb.tensor_type, ta.name
        raw = np.asarray(a.data[ta.data_offset:ta.data_offset + ta.n_bytes])
        layer = int(ta.name.split(".")[1]) if ta.name.startswith("blk.") else None
        if is_per_expert(ta.name, layer):
            raw = np.concatenate([s for e, s in enumerate(np.split(raw, 8)) if e in kept[layer]])
        assert np.asarray(b.data[tb.data_offset:tb.data_offset + tb.n_bytes]).tobytes() == raw.tobytes(), ta.name
    before, after = _fields(k31pro_tiny_gguf), _fields(out)
    assert after.pop(K.EXPERT_COUNT) == n and after.pop(f"{K.ARCH}.expert_used_count") == min(2, n)
    assert after.pop(K.PRUNED_EXPERT_COUNT) == 8
    assert after.pop(K.PRUNED_KEPT_EXPERTS) == [e for l in MOE_LAYERS for e in kept[l]]
    before.pop(K.EXPERT_COUNT), before.pop(f"{K.ARCH}.expert_used_count")
    assert after == before
    check_hashes(out, read_manifest(out))  # its own integrity manifest


def test_keeping_every_expert_copies_every_tensor(k31pro_tiny_gguf, tmp_path):
    out = _pruned(k31pro_tiny_gguf, tmp_path, {l: list(range(8)) for l in MOE_LAYERS})
    a, b = GGUFReader(k31pro_tiny_gguf), GGUFReader(out)
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        assert ta.data.tobytes() == tb.data.tobytes()


def test_a_pruned_gguf_verifies_against_the_checkpoint(k31pro_tiny_gguf, tmp_path, capsys):
    out = _pruned(k31pro_tiny_gguf, tmp_path, _pattern(3))
    assert convert_kimi_k3.main(["--verify", str(out), str(K31PRO_TINY)]) == 0
    assert "tensors match" in capsys.readouterr().out
    assert diff_main([str(K31PRO_TINY), str(out), "--layers", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "blk.4.ffn_down_exps.weight  exact" in lines and "blk.4.ffn_gate_inp.weight  exact" in lines


def test_the_diff_catches_a_wrong_original_id(k31pro_tiny_gguf, tmp_path, capsys):
    kept = _pattern(3)
    out = _pruned(k31pro_tiny_gguf, tmp_path, kept)
    lie = dict(kept)
    lie[6] = sorted(set(range(8)) - set(kept[6]))[:3]  # layer 6 claims three other experts
    flat = [e for l in MOE_LAYERS for e in lie[l]]
    bad = rewritten_copy(out, tmp_path / "lie.gguf", keys={K.PRUNED_KEPT_EXPERTS: (flat, T.ARRAY, T.UINT32)})
    assert diff_main([str(K31PRO_TINY), str(bad), "--layers", "5,6"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "blk.5.ffn_up_exps.weight  exact" in lines
    assert any(l.startswith("blk.6.ffn_up_exps.weight  MISMATCH") for l in lines)
    assert any(l.startswith("blk.6.exp_probs_b.bias  MISMATCH") for l in lines)


def test_pruning_a_pruned_gguf_records_the_checkpoints_ids(k31pro_tiny_gguf, tmp_path):
    first = _pruned(k31pro_tiny_gguf, tmp_path, {l: [0, 2, 3, 5, 6, 7] for l in MOE_LAYERS}, "six.gguf")
    second = _pruned(first, tmp_path, {l: [1, 4, 5] for l in MOE_LAYERS}, "three.gguf")
    assert _fields(second)[K.PRUNED_KEPT_EXPERTS] == [2, 6, 7] * len(MOE_LAYERS)
    assert convert_kimi_k3.main(["--verify", str(second), str(K31PRO_TINY)]) == 0


def test_reads_are_bounded(k31pro_tiny_gguf, tmp_path, monkeypatch):
    reference = _pruned(k31pro_tiny_gguf, tmp_path, _pattern(4), "ref.gguf")
    sizes = []
    real_pread = os.pread
    monkeypatch.setattr(prune, "READ_BYTES", 1000)
    monkeypatch.setattr(prune.os, "pread", lambda fd, n, off: sizes.append(n) or real_pread(fd, n, off))
    small = _pruned(k31pro_tiny_gguf, tmp_path, _pattern(4), "small.gguf")
    assert max(sizes) == 1000 and len(sizes) > 1000
    assert small.read_bytes() == reference.read_bytes()


def test_top_experts_ranks_by_saliency_then_count_then_id():
    stats = LayerSaliency(np.array([3, 0, 5, 5, 1]), np.array([0.5, 0.0, 0.7, 0.7, 0.9]))
    assert top_experts(stats, 1) == (4,)
    assert top_experts(stats, 2) == (2, 4)  # 2 and 3 tie on saliency and count: the lower id
    assert top_experts(stats, 4) == (0, 2, 3, 4)


# ---- pruning by a calibration: what the text used survives, its logits do not move -------------

def _calibrated(gguf: Path, d: Path, text: str, exact: bool) -> tuple[Path, list[int]]:
    """The saliency file of `text` and how many experts each layer routed it to."""
    (d / "short.txt").write_text(text)
    sal = d / "short.json"
    path = ["--exact-experts"] if exact else []
    assert calibrate(["-m", str(gguf), "-f", str(d / "short.txt"), "-o", str(sal), "-t", "2", *path]) == 0
    used = [int((np.array(e["count"]) > 0).sum()) for e in json.loads(sal.read_text())["layers"].values()]
    return sal, used


def _logits(gguf: Path, text: str, exact: bool) -> np.ndarray:
    m = Model.load(gguf, n_ctx=64, exact_experts=exact, n_threads=2)
    try:
        return m.eval(BPETokenizer.from_gguf(gguf).encode(text))
    finally:
        m.close()


# Exact path: 12 characters are 6 tokens, 16 are 8, the two kernels of ggml's F32 matmul for the
# router (llamafile's sgemm takes row counts divisible by 4, blocks/moe.py). Fast path (llama.cpp's
# order, the expert count picks the kernel): 4 characters, 2 tokens, route to at most 4 experts a
# layer, so 4 of 8 are kept, both counts multiples of 4. Each text leaves experts unused.
@pytest.mark.parametrize("exact, chars", [(True, 12), (True, 16), (False, 4)], ids=["exact-6", "exact-8", "fast-2"])
def test_pruning_to_the_experts_a_text_used_leaves_its_logits_unchanged(k31pro_tiny_gguf, tmp_path, chars, exact):
    text = PROSE.read_text()[:chars]
    sal, used = _calibrated(k31pro_tiny_gguf, tmp_path, text, exact)
    n = max(used)
    assert min(used) < n < 8, "the text must leave experts unused, and some layer at the maximum"
    out = tmp_path / "used.gguf"
    assert main([str(k31pro_tiny_gguf), str(out), "--saliency", str(sal), "--keep-used", "--quiet"]) == 0
    assert _fields(out)[K.EXPERT_COUNT] == n
    full = _logits(k31pro_tiny_gguf, text, exact)
    np.testing.assert_array_equal(_logits(out, text, exact), full)
    # one expert fewer drops a used expert of the layers at the maximum: the logits move
    fewer = tmp_path / "fewer.gguf"
    assert main([str(k31pro_tiny_gguf), str(fewer), "--saliency", str(sal), "--keep-experts", str(n - 1)]) == 0
    assert np.abs(_logits(fewer, text, exact) - full).max() > 1e-3


# ---- the command line ------------------------------------------------------------------------

def _saliency_doc(n_expert: int = 8) -> dict:
    layer = {"count": [1] * n_expert, "saliency": [0.5] * n_expert}
    return {"format": "kimi-k3-saliency/1", "expert_count": n_expert,
            "layers": {str(l): {**layer, "by_tag": {"prose": layer}} for l in MOE_LAYERS}}


@pytest.mark.parametrize("args, says", [
    (["--keep-experts", "0"], "--keep-experts must be in 1..8"),
    (["--keep-experts", "9"], "--keep-experts must be in 1..8"),
    (["--keep-experts", "3", "--tag", "code"], "no tag 'code'"),
    (["--keep-experts", "3", "--saliency", "OTHER"], "expert_count is 4, the GGUF has 8"),
    (["--keep-experts", "3", "--saliency", "MISSING"], "no such saliency file"),
    (["--plan", "UNEVEN"], "layers keep [2, 3] experts"),
    (["--plan", "PARTIAL"], "with every MoE layer"),
    (["--plan", "DUPLICATE"], "expected distinct expert ids in 0..7"),
    (["--plan", "UNEVEN", "--saliency", "GOOD"], "--plan names the experts itself"),
])
def test_bad_input_is_a_one_line_error(k31pro_tiny_gguf, tmp_path, capsys, args, says):
    (tmp_path / "good.json").write_text(json.dumps(_saliency_doc()))
    (tmp_path / "other.json").write_text(json.dumps(_saliency_doc(4)))
    files = {"GOOD": tmp_path / "good.json", "OTHER": tmp_path / "other.json", "MISSING": tmp_path / "nope.json",
             "UNEVEN": _plan(tmp_path, {l: [0, 1] if l % 2 else [0, 1, 2] for l in MOE_LAYERS}, "uneven.json"),
             "PARTIAL": _plan(tmp_path, {1: [0, 1]}, "partial.json"),
             "DUPLICATE": _plan(tmp_path, {l: [1, 1] for l in MOE_LAYERS}, "dup.json")}
    args = [str(files.get(a, a)) for a in args]
    if "--saliency" not in args and "--plan" not in args:
        args += ["--saliency", str(files["GOOD"])]
    out = tmp_path / "out.gguf"
    assert main([str(k31pro_tiny_gguf), str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert not out.exists() and not (tmp_path / "out.gguf.partial").exists()


def test_ranking_needs_a_saliency_file(k31pro_tiny_gguf, tmp_path, capsys):
    assert main([str(k31pro_tiny_gguf), str(tmp_path / "o.gguf"), "--keep-used"]) == 2
    assert "rank experts by --saliency" in capsys.readouterr().err


def test_output_rules(k31pro_tiny_gguf, tmp_path, capsys):
    plan = _plan(tmp_path, {l: [0, 1] for l in MOE_LAYERS})
    out = tmp_path / "o.gguf"
    out.write_text("mine")
    assert main([str(k31pro_tiny_gguf), str(out), "--plan", str(plan)]) == 1
    assert "already exists (use --overwrite" in capsys.readouterr().err and out.read_text() == "mine"
    assert main([str(k31pro_tiny_gguf), str(k31pro_tiny_gguf), "--plan", str(plan), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "is IN.gguf" in err and "which this run reads" in err
    link = tmp_path / "link.gguf"
    link.symlink_to(out)
    assert main([str(k31pro_tiny_gguf), str(link), "--plan", str(plan)]) == 1  # never written through
    assert "is a symbolic link" in capsys.readouterr().err and out.read_text() == "mine"
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF but not really")
    assert main([str(fake), str(tmp_path / "x.gguf"), "--plan", str(plan)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {fake}")


def test_rank_frequency_keeps_the_most_routed(k31pro_tiny_gguf, tmp_path):
    doc = _saliency_doc()
    for l in MOE_LAYERS:  # experts 5..7 are routed most but have the smallest mean contribution
        doc["layers"][str(l)].update(count=[1, 1, 1, 1, 1, 9, 9, 9], saliency=[0.9] * 5 + [0.1] * 3)
    sal = tmp_path / "s.json"
    sal.write_text(json.dumps(doc))
    for rank, kept in (("reap", [0, 1, 2]), ("frequency", [5, 6, 7])):
        out = tmp_path / f"{rank}.gguf"
        assert main([str(k31pro_tiny_gguf), str(out), "--saliency", str(sal), "--keep-experts", "3",
                     "--rank", rank]) == 0
        assert _fields(out)[K.PRUNED_KEPT_EXPERTS] == kept * len(MOE_LAYERS)


@pytest.mark.parametrize("keys, says", [
    ({K.PRUNED_EXPERT_COUNT: None}, "without its companion key"),
    ({K.PRUNED_KEPT_EXPERTS: ([1, 0] * 12, T.ARRAY, T.UINT32)}, "distinct ascending ids in 0..7"),
    ({K.PRUNED_KEPT_EXPERTS: ([0, 1] * 11, T.ARRAY, T.UINT32)}, "must list 2 ids for each of the 12 MoE layers"),
    ({K.PRUNED_EXPERT_COUNT: (1, T.UINT32)}, "expected at least expert_count 2"),
])
def test_malformed_pruning_keys_are_bad_input(k31pro_tiny_gguf, tmp_path, capsys, keys, says):
    pruned = _pruned(k31pro_tiny_gguf, tmp_path, {l: [0, 1] for l in MOE_LAYERS})
    bad = rewritten_copy(pruned, tmp_path / "bad.gguf", keys=keys)
    plan = _plan(tmp_path, {l: [0] for l in MOE_LAYERS}, "one.json")
    assert main([str(bad), str(tmp_path / "o.gguf"), "--plan", str(plan)]) == 2
    assert says in capsys.readouterr().err
    assert diff_main([str(K31PRO_TINY), str(bad)]) == 2
    assert says in capsys.readouterr().err
