"""The synthetic checkpoint generator: real on-disk format, the table's tensors, determinism,
bounded memory, tokenizer files, and that the converter and the graph take its output."""
from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch
from gguf import GGUFReader
from safetensors import safe_open
from safetensors.torch import save as st_save

from ggml_graph_spec.engine.model import Model
from gguf_arch.arch.config import load_config
from gguf_arch.convert.run import convert
from gguf_arch.verify.diff import diff_gguf
from gguf_arch.errors import EXIT_BAD_INPUT, EXIT_RUNTIME
from gguf_arch.arch.keys import ARCH, INDEXER_TOP_K
from gguf_arch.io.safetensors_write import StreamedTensor, write_safetensors
from gguf_arch.synth.cli import INDEX_FILE, main, plan_checkpoint, write_checkpoint
from gguf_arch.synth.config import LARGE, SPECIAL_OFFSETS, TINY
from gguf_arch.synth.tokenizer import ranks_for_vocab
from gguf_arch.synth.weights import ROW_INIT, mxfp4_scale_range, to_bf16
from gguf_arch.arch.tensors import SKIP_PREFIXES, TEXT_PREFIX, plan_tensors, specs_by_gguf_template
from tests.support.paths import FIXTURES, REPO

FIXTURE_OF = {"k3": "k3-tiny", "k31pro": "k31pro-tiny"}
# Other sizes than the presets, to show that every dimension flows through the table.
ODD_DIMS = {**TINY, "layers": 6, "hidden": 96, "experts": 5, "experts-per-token": 3, "moe-intermediate": 64,
            "latent": 96, "kda-heads": 3, "kda-head-dim": 8, "mla-heads": 2, "q-lora": 24, "index-heads": 3,
            "index-head-dim": 8, "vocab": 700, "dense-layers": 2}


def _generate(out: Path, variant: str = "k31pro", dims: dict | None = None, seed: int = 0) -> Path:
    write_checkpoint(plan_checkpoint(dims or TINY, variant, seed), out)
    return out


@pytest.fixture(scope="module", params=["k3", "k31pro"])
def tiny(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _generate(tmp_path_factory.mktemp("synth") / "tiny", request.param)


@pytest.fixture(scope="module")
def odd(tmp_path_factory) -> Path:
    return _generate(tmp_path_factory.mktemp("synth") / "odd", "k31pro", ODD_DIMS)


def _header(path: Path) -> tuple[bytes, dict]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        raw = f.read(n)
    return raw, json.loads(raw)


def _headers(model: Path) -> dict[str, dict]:
    """tensor name -> header entry (plus its shard) over every shard of the index."""
    index = json.loads((model / INDEX_FILE).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        _, h = _header(model / shard)
        out.update({k: {**v, "shard": shard} for k, v in h.items() if k != "__metadata__"})
    return out


# ---- the real on-disk format -------------------------------------------------------------

@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", INDEX_FILE])
def test_tiny_files_are_byte_identical_to_the_fixture(tiny, name):
    """The tiny preset has the fixtures' sizes, so its metadata files equal theirs byte for byte."""
    variant, model = tiny
    assert (model / name).read_bytes() == (FIXTURES / FIXTURE_OF[variant] / name).read_bytes()


def test_tiny_shard_headers_are_byte_identical_to_the_fixture(tiny):
    """Same shard names, tensor placement, order, dtypes, shapes, offsets and padding as the fixture."""
    variant, model = tiny
    fixture = FIXTURES / FIXTURE_OF[variant]
    ours = sorted(p.name for p in model.glob("*.safetensors"))
    assert ours == sorted(p.name for p in fixture.glob("*.safetensors"))
    for name in ours:
        assert _header(model / name)[0] == _header(fixture / name)[0], name
        assert (model / name).stat().st_size == (fixture / name).stat().st_size, name


def test_shards_are_byte_identical_to_safetensors_own_writer(tiny):
    """The streaming writer lays files out exactly as safetensors.torch.save does."""
    _, model = tiny
    for shard in sorted(model.glob("model-*.safetensors")):
        with safe_open(shard, "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata()
        assert meta == {"format": "pt"}
        assert st_save(tensors, metadata=meta) == shard.read_bytes(), shard.name


def test_writer_rejects_a_tensor_that_yields_the_wrong_byte_count(tmp_path):
    short = StreamedTensor("t", "F32", (4,), lambda: [b"\0" * 12])
    with pytest.raises(ValueError, match="produced 12 bytes, its header says 16"):
        write_safetensors(tmp_path / "x.safetensors", [short], {"format": "pt"})


def test_total_size_is_the_sum_of_tensor_bytes(odd):
    index = json.loads((odd / INDEX_FILE).read_text())
    data = 0
    for shard in set(index["weight_map"].values()):
        raw, _ = _header(odd / shard)
        data += (odd / shard).stat().st_size - 8 - len(raw)
    sizes = {"BF16": 2, "F32": 4, "U8": 1}
    from_headers = sum(int(np.prod(h["shape"])) * sizes[h["dtype"]] for h in _headers(odd).values())
    assert index["metadata"]["total_size"] == data == from_headers


def test_shard_per_layer_then_globals_projector_vision(odd):
    cfg = load_config(odd)
    n_shards = cfg.num_layers + 3
    for name, h in _headers(odd).items():
        m = re.match(r"language_model\.model\.layers\.(\d+)\.", name)
        if m:
            want = int(m.group(1)) + 1
        elif name.startswith(TEXT_PREFIX):
            want = cfg.num_layers + 1
        else:
            want = cfg.num_layers + (2 if name.startswith("mm_projector.") else 3)
        assert h["shard"] == f"model-{want:05d}-of-{n_shards:06d}.safetensors", name


# ---- the table's tensors ------------------------------------------------------------------

def _table_sources(cfg) -> dict[str, tuple]:
    out = {}
    for planned in plan_tensors(cfg):
        if planned.spec.optional:
            continue
        for i, (name, shape) in enumerate(planned.sources):
            out[name] = (shape, planned.spec.sources[i % len(planned.spec.sources)].dtypes)
    return out


@pytest.mark.parametrize("which", ["tiny", "odd"])
def test_every_tensor_is_a_table_source_or_skipped_and_back(which, tiny, odd):
    model = tiny[1] if which == "tiny" else odd
    cfg = load_config(model)
    headers = _headers(model)
    index = json.loads((model / INDEX_FILE).read_text())["weight_map"]
    assert set(index) == set(headers)
    text = {n: h for n, h in headers.items() if not n.startswith(SKIP_PREFIXES)}
    assert all(n.startswith(TEXT_PREFIX) for n in text)
    assert len(headers) > len(text)  # the vision tower and projector are there, to be skipped
    table = _table_sources(cfg)
    assert set(text) == set(table)
    for name, (shape, dtypes) in table.items():
        assert tuple(text[name]["shape"]) == shape, name
        assert text[name]["dtype"] in dtypes, name


def test_odd_dimensions_reach_the_config(odd):
    cfg = load_config(odd)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.kda.num_heads, cfg.kda.head_dim) == (6, 96, 5, 3, 8)
    assert cfg.kda.layers == (0, 1, 2, 4) and cfg.mla_layers == (3, 5)
    assert cfg.indexer.layers == cfg.mla_layers and cfg.moe_layers == (2, 3, 4, 5)
    assert cfg.vocab_size == 700


def test_init_policy_names_only_table_rows():
    assert set(ROW_INIT) <= set(specs_by_gguf_template())


# ---- values -------------------------------------------------------------------------------

def _values(model: Path) -> dict[str, np.ndarray]:
    out = {}
    for shard in model.glob("model-*.safetensors"):
        with safe_open(shard, "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                out[k] = t.numpy() if t.dtype == torch.uint8 else t.float().numpy()
    return out


def test_values_are_finite_with_exact_a_log_padding_and_sane_scales(odd):
    cfg = load_config(odd)
    values = _values(odd)
    heads = cfg.kda.num_heads
    for name, v in values.items():
        assert np.isfinite(v).all(), name
        if name.endswith("A_log"):
            assert (v[:heads] != 0).all() and (v[heads:] == 0).all(), name
        if name.endswith("weight_scale"):
            fan_in = v.shape[1] * cfg.mxfp4_group_size
            lo, hi = mxfp4_scale_range(fan_in)
            assert v.min() >= lo and v.max() <= hi and 110 <= lo and hi <= 127, name
        if name.endswith("weight_packed"):
            assert len(np.unique(v & 0xF)) == 16, name  # every E2M1 code occurs, -0 included


def test_bf16_rounds_to_nearest_even_like_torch():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(20_000) * 10.0 ** rng.integers(-8, 8, 20_000)).astype(np.float32)
    halfway = (rng.integers(0, 0x7F7F, 2_000, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # finite exact ties
    x = np.concatenate([x, halfway, -halfway])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(to_bf16(x), want)


def _stats_by_template(model: Path) -> dict[str, tuple[float, float]]:
    groups = defaultdict(list)
    for name, v in _values(model).items():
        groups[re.sub(r"\.\d+\.", ".N.", name)].append(v.astype(np.float64).ravel())
    return {k: (np.concatenate(v).mean(), np.concatenate(v).std()) for k, v in groups.items()}


def test_weight_scales_match_the_fixture(tiny):
    """The fixtures' reference run showed O(1) activations and varied logits with these scales.

    Text tensors only: the vision tower is skipped, its values do not matter."""
    variant, model = tiny
    ours, theirs = _stats_by_template(model), _stats_by_template(FIXTURES / FIXTURE_OF[variant])
    assert set(ours) == set(theirs)
    for name, (mean, std) in theirs.items():
        if not name.startswith(TEXT_PREFIX):
            continue
        got_mean, got_std = ours[name]
        assert abs(got_mean - mean) <= 0.05 + 0.3 * std, (name, got_mean, mean)
        assert 0.7 <= got_std / std <= 1.4, (name, got_std, std)


# ---- determinism --------------------------------------------------------------------------

def _digest(model: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model.iterdir())}


def test_same_arguments_give_byte_identical_files(tmp_path, odd):
    assert _digest(_generate(tmp_path / "again", "k31pro", ODD_DIMS)) == _digest(odd)


def test_another_seed_gives_other_weights(tmp_path, odd):
    other = _digest(_generate(tmp_path / "seed1", "k31pro", ODD_DIMS, seed=1))
    ours = _digest(odd)
    assert other["config.json"] == ours["config.json"]
    assert all(other[n] != ours[n] for n in ours if n.endswith(".safetensors"))


# ---- large preset, bounded memory, speed --------------------------------------------------

def test_large_preset_has_real_sizes_and_several_gigabytes():
    plan = plan_checkpoint(LARGE, "k31pro", 0)
    cfg = plan.cfg
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.latent_size) == (7168, 3072, 3584)
    assert (cfg.kda.num_heads, cfg.kda.head_dim, cfg.num_heads) == (96, 128, 96)
    assert cfg.is_kda(0) and not cfg.is_moe(0) and cfg.is_dsa(cfg.num_layers - 1)
    assert any(cfg.is_kda(l) and cfg.is_moe(l) for l in range(cfg.num_layers))
    assert 4e9 < plan.total_size < 16e9


_MEDIUM = ["--layers", "2", "--hidden", "512", "--latent", "1024", "--moe-intermediate", "1024",
           "--experts", "128", "--intermediate", "512"]


def test_peak_memory_stays_far_below_the_largest_shard(tmp_path):
    """A medium checkpoint whose MoE shard is over 200 MB is written with a small, flat RSS."""
    script = ("import resource, sys; from gguf_arch.synth.cli import main; rc = main(sys.argv[1:]); "
              "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")
    out = tmp_path / "medium"
    run = subprocess.run([sys.executable, "-c", script, str(out), *_MEDIUM], capture_output=True, text=True,
                         cwd=REPO, check=True)
    peak_mib = int(run.stdout.split()[-1]) / 1024
    largest = max(p.stat().st_size for p in out.glob("*.safetensors"))
    assert largest > 200 * 2**20
    baseline = subprocess.run([sys.executable, "-c", "import resource, gguf_arch.synth.cli; "
                               "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"],
                              capture_output=True, text=True, cwd=REPO, check=True)
    growth_mib = peak_mib - int(baseline.stdout) / 1024
    assert growth_mib < 64, f"RSS grew by {growth_mib:.0f} MiB while writing a {largest / 2**20:.0f} MiB shard"


# ---- tokenizer ----------------------------------------------------------------------------

def _ranks(model: Path) -> dict[bytes, int]:
    lines = (model / "tiktoken.model").read_text().splitlines()
    return {base64.b64decode(t): int(r) for t, r in (line.split() for line in lines)}


def test_ranks_are_a_consistent_bpe_vocabulary(odd):
    """Each merged token, encoded by tiktoken with the lower ranks only, is exactly two tokens
    (what merge recovery from tiktoken ranks relies on)."""
    ranks = _ranks(odd)
    assert sorted(ranks.values()) == list(range(len(ranks)))
    assert all(ranks[bytes([b])] == b for b in range(256))
    by_rank = sorted(ranks, key=ranks.get)
    for rank in range(256, len(by_rank)):
        lower = tiktoken.Encoding(f"lower{rank}", pat_str=r"\s+", mergeable_ranks=dict(zip(by_rank[:rank], range(rank))),
                                  special_tokens={})
        assert len(lower._encode_single_piece(by_rank[rank])) == 2, by_rank[rank]


def test_tiktoken_round_trips_with_the_special_block(odd):
    cfg = load_config(odd)
    ranks = _ranks(odd)
    tok_cfg = json.loads((odd / "tokenizer_config.json").read_text())
    specials = {v["content"]: int(k) for k, v in tok_cfg["added_tokens_decoder"].items()}
    assert len(specials) == 256 and min(specials.values()) == len(ranks) and cfg.vocab_size == len(ranks) + 256
    assert {specials[name] - len(ranks): name for name in SPECIAL_OFFSETS.values()} == SPECIAL_OFFSETS
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        specials["[BOS]"], specials["<|end_of_msg|>"], specials["[PAD]"])
    enc = tiktoken.Encoding("synth", pat_str=r" ?\w+| ?[^\s\w]+|\s+", mergeable_ranks=ranks, special_tokens=specials)
    text = "[BOS]The keeper walked to the harbour at night, 1987 (grüße)."
    ids = enc.encode(text, allowed_special="all")
    assert ids[0] == cfg.bos_token_id and enc.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # merges are in use


def test_vocab_beyond_the_training_text_is_a_clear_error():
    with pytest.raises(Exception, match="BPE merges; the built-in training text yields only"):
        ranks_for_vocab(100_000)


# ---- command line ---------------------------------------------------------------------------

def test_cli_writes_and_refuses_a_non_empty_directory(tmp_path, capsys):
    out = tmp_path / "m"
    assert main([str(out), "--variant", "k3"]) == 0
    assert main([str(out)]) == EXIT_RUNTIME
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not empty" in err[0] and "--overwrite" in err[0]
    assert main([str(out), "--layers", "5", "--overwrite"]) == 0
    assert sorted(p.name for p in out.glob("*.safetensors"))[-1] == "model-00008-of-000008.safetensors"
    assert len(list(out.glob("*.safetensors"))) == 8  # the 16 shards of the first run are gone


def test_cli_bad_dimension_is_one_line_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "m"), "--moe-intermediate", "33"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "moe_intermediate_size must be a multiple of 32" in err[0]
    assert not (tmp_path / "m").exists()


def test_console_module_dry_run(tmp_path):
    run = subprocess.run([sys.executable, "-m", "gguf_arch.synth.cli", str(tmp_path / "m"), "--preset", "large",
                          "--dry-run"], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert "model-00007-of-000007.safetensors" in run.stdout and "would write 7 shards" in run.stdout
    assert not (tmp_path / "m").exists()


# ---- the converter takes it ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tiny, tmp_path_factory) -> tuple[Path, Path]:
    model = tiny[1]
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    convert(model, out, log=lambda _msg: None)
    return model, out


def test_tiny_synthetic_model_converts(tiny_gguf):
    model, out = tiny_gguf
    cfg = load_config(model)
    reader = GGUFReader(out)
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == ARCH
    assert len(reader.tensors) == sum(1 for p in plan_tensors(cfg) if not p.spec.optional)
    assert (INDEXER_TOP_K in reader.fields) == (cfg.indexer is not None)


def test_tiny_synthetic_model_diffs_exact(tiny_gguf):
    model, out = tiny_gguf
    report = diff_gguf(model, out)
    bad = [t.line() for t in report.tensors if not t.ok]
    assert report.ok, f"{report.summary()}; " + "; ".join(bad[:4])


def test_tiny_synthetic_model_runs_with_o1_activations_and_varied_greedy_tokens(tiny_gguf):
    """As the fixtures' reference run: hidden RMS ~1-3, logits std ~3, greedy tokens vary, no NaN."""
    model = Model.load(tiny_gguf[1], n_ctx=64)
    bos = load_config(tiny_gguf[0]).bos_token_id
    result = model.run([bos, *range(300, 311)], want=["hidden"])
    assert np.isfinite(result.logits).all() and 1.0 < result.logits.std() < 10.0
    for layer, hidden in result.hidden.items():
        assert 0.3 < np.sqrt(np.mean(hidden.astype(np.float64) ** 2)) < 10.0, layer
    tokens, logits = [], result.logits[-1]
    for _ in range(12):
        tokens.append(int(np.argmax(logits)))
        logits = model.eval([tokens[-1]])[-1]
    assert len(set(tokens)) >= 6, tokens
