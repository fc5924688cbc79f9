"""Open a kimi-k3 GGUF, check it completely, and hand its weights to ggml without copying.

Everything a ggml op could trip over is checked here first, with one-line `GGUFError`s: a ggml
assert aborts the process, so it must never see a file we have not validated. The checks read
the project's tables: the keys through `gguf_arch.arch.keys.model_keys` and the tensors through
`gguf_arch.arch.tensors.plan_tensors`, so this module spells no key or tensor name of its own.

Zero copy: gguf-py memory-maps the file (np.memmap, read-only). The mapping is page aligned and
every tensor offset is a multiple of the file's alignment, so the whole mapping is wrapped as one
CPU backend buffer (`ggml_backend_cpu_buffer_from_ptr`) and each ggml tensor is pointed at its
bytes inside it (`ggml_backend_tensor_alloc`). The weights are read-only: no op may write them.

With `repack=True` the routed experts are copied into ggml's repacked layout instead
(`repack.py`).
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import ggml
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType

from gguf_arch.arch import keys as K
from gguf_arch.arch.config import IndexerConfig, K3Config, KDAConfig
from gguf_arch.errors import GGUFError
from gguf_arch.io.gguf_file import open_gguf
from gguf_arch.io.gguf_values import problem as value_problem
from gguf_arch.io.split_names import part_paths
from gguf_arch.arch.tensors import OUT_F32, OUT_MXFP4, OUT_SOURCE, PlannedTensor, plan_tensors
from quant_rules.rules import EXPERT_TYPES, WRITABLE_TYPES

from .repack import Repacked, Source, repack_experts

# Types a "source precision" tensor (matrices, embeddings) may have: every type the converter
# can write (quant_rules: --outtype / --tensor-type) plus the K-quants llama-quantize writes;
# ggml's CPU matmul and get_rows handle all of them. Contract-F32 tensors are all protected
# (quant_rules/protected.json), so F32 only; the routed experts are MXFP4 or what
# --requantize-experts writes.
SOURCE_TYPES = frozenset(WRITABLE_TYPES) | {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
_ALLOWED_TYPES = {OUT_SOURCE: SOURCE_TYPES, OUT_F32: frozenset({Q.F32}),
                  OUT_MXFP4: frozenset({Q.MXFP4, *EXPERT_TYPES})}

_TOKENIZER_IDS = {"bos_token_id": "tokenizer.ggml.bos_token_id",
                  "eos_token_id": "tokenizer.ggml.eos_token_id",
                  "pad_token_id": "tokenizer.ggml.padding_token_id"}
# Not stored in the GGUF because llama.cpp's kimi-k3 graph hard-wires them; the tensor check
# below rejects a file whose layout disagrees.
_MOE_LAYER_FREQ = 1
_MXFP4_BLOCK = 32  # ggml's QK_MXFP4


# ---------------------------------------------------------------------------------------------
# metadata -> K3Config
# ---------------------------------------------------------------------------------------------

def read_metadata(readers: list[GGUFReader]) -> dict[str, Any]:
    """Every key/value of the (first) file, values as Python objects."""
    return {name: _contents(readers[0], name, f) for name, f in readers[0].fields.items()
            if not name.startswith("GGUF.")}


def _contents(reader: GGUFReader, name: str, f) -> Any:
    # gguf-py decodes string values only here, not when it opens the file.
    try:
        return f.contents()
    except UnicodeDecodeError:
        raise GGUFError(f"{reader.data.filename}: metadata {name!r} holds a string that is not valid UTF-8") from None


def _need(meta: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in meta:
        raise GGUFError(f"{where}: missing metadata key {key!r}")
    return meta[key]


def config_from_metadata(meta: Mapping[str, Any], where: str) -> K3Config:
    """Rebuild the architecture from the kimi-k3 keys, then check the file against the key table.

    Each K3Config field is read from the one key the table writes it to; the round trip through
    `keys.model_keys(cfg)` then compares every key of the table with the file, so a wrong value,
    a wrong type or a missing key is reported against the table, not against a copy of it.
    """
    arch = meta.get("general.architecture")
    if arch != K.ARCH:
        raise GGUFError(f"{where}: general.architecture is {arch!r}, expected {K.ARCH!r}")
    a = lambda name: _need(meta, f"{K.ARCH}.{name}", where)  # noqa: E731
    kv_heads = a("attention.head_count_kv")
    n_layers = a("block_count")
    if not isinstance(kv_heads, list) or len(kv_heads) != n_layers or set(kv_heads) - {0, 1}:
        raise GGUFError(f"{where}: {K.ARCH}.attention.head_count_kv must be a list of {n_layers} "
                        f"values 0 (KDA) or 1 (MLA), got {kv_heads!r}")
    rope = a("rope.dimension_count")
    cfg = K3Config(
        vocab_size=a("vocab_size"), hidden_size=a("embedding_length"), num_layers=n_layers,
        num_heads=a("attention.head_count"), intermediate_size=a("feed_forward_length"),
        moe_intermediate_size=a("expert_feed_forward_length"), num_experts=a("expert_count"),
        num_experts_used=a("expert_used_count"), num_shared_experts=a("expert_shared_count"),
        first_k_dense_replace=a("leading_dense_block_count"), moe_layer_freq=_MOE_LAYER_FREQ,
        latent_size=a("expert_latent_length"), latent_moe_use_norm=True,
        moe_renormalize=a("expert_weights_norm"), routed_scaling_factor=a("expert_weights_scale"),
        topk_group=a("expert_group_used_count"), q_lora_rank=a("attention.q_lora_rank"),
        kv_lora_rank=a("attention.kv_lora_rank"), qk_nope_head_dim=a("attention.key_length_mla") - rope,
        qk_rope_head_dim=rope, v_head_dim=a("attention.value_length_mla"),
        situ_beta=a("activation.situ_beta"), situ_linear_beta=a("activation.situ_linear_beta"),
        attn_res_block_size=a("attn_res.block_size"), rms_norm_eps=a("attention.layer_norm_rms_epsilon"),
        context_length=a("context_length"),
        # Tokenizer ids do not shape the graph; -1 marks a file written without them.
        **{f: int(meta.get(key, -1)) for f, key in _TOKENIZER_IDS.items()},
        # llama.cpp sizes the KDA heads from attention.head_count too (findings.md).
        kda=KDAConfig(a("attention.head_count"), a("kda.head_dim"), a("ssm.conv_kernel"),
                      a("kda.gate_lower_bound"), tuple(l for l, h in enumerate(kv_heads) if h == 0)),
        mla_layers=tuple(l for l, h in enumerate(kv_heads) if h == 1),
        mxfp4_group_size=_MXFP4_BLOCK,
        indexer=_indexer_from_metadata(meta, where),
    )
    _check_against_key_table(cfg, meta, where)
    return cfg


def _indexer_from_metadata(meta: Mapping[str, Any], where: str) -> IndexerConfig | None:
    present = [k for k in K.INDEXER_KEYS if k in meta]
    if not present:
        return None
    if len(present) != len(K.INDEXER_KEYS):
        absent = [k for k in K.INDEXER_KEYS if k not in meta]
        raise GGUFError(f"{where}: has {', '.join(present)} but not {', '.join(absent)} "
                        "(the indexer keys come together or not at all)")
    layers = meta[K.INDEXER_LAYERS]
    if not isinstance(layers, list):
        raise GGUFError(f"{where}: {K.INDEXER_LAYERS} must be an array of layer ids, got {layers!r}")
    return IndexerConfig(meta[K.INDEXER_HEAD_COUNT], meta[K.INDEXER_KEY_LENGTH], meta[K.INDEXER_TOP_K],
                         tuple(layers))


def _same(want: Any, got: Any, vtype: GGUFValueType) -> bool:
    if vtype == GGUFValueType.FLOAT32:
        return isinstance(got, float) and np.float32(want) == np.float32(got)
    if vtype == GGUFValueType.BOOL:
        return isinstance(got, bool) and got == want
    return type(got) is type(want) and got == want


def _check_against_key_table(cfg: K3Config, meta: Mapping[str, Any], where: str) -> None:
    for key, want, vtype, sub in K.model_keys(cfg):
        got = _need(meta, key, where)
        why = value_problem(vtype, got, sub)  # a NaN, or a negative value stored in a signed type
        if why is not None:
            raise GGUFError(f"{where}: metadata {key} {why}")
        if not _same(want, got, vtype):
            raise GGUFError(f"{where}: metadata {key} is {got!r}, expected {want!r} "
                            "(inconsistent with the other kimi-k3 keys)")
    if cfg.indexer is not None and set(cfg.indexer.layers) != set(cfg.mla_layers):
        raise GGUFError(f"{where}: {K.INDEXER_LAYERS} {list(cfg.indexer.layers)} must equal the MLA "
                        f"layers {list(cfg.mla_layers)} (head_count_kv == 1)")
    for name, value in (("vocab_size", cfg.vocab_size), ("embedding_length", cfg.hidden_size),
                        ("block_count", cfg.num_layers), ("expert_count", cfg.num_experts),
                        ("kda.head_dim", cfg.kda.head_dim), ("ssm.conv_kernel", cfg.kda.conv_kernel),
                        # the AttnRes block and the indexer's top-k divide or size the graph
                        ("attn_res.block_size", cfg.attn_res_block_size),
                        *((("attention.indexer.top_k", cfg.indexer.top_k), ("attention.indexer.head_count",
                            cfg.indexer.n_heads), ("attention.indexer.key_length", cfg.indexer.head_dim))
                          if cfg.indexer is not None else ())):
        if value < 1:
            raise GGUFError(f"{where}: {K.ARCH}.{name} must be >= 1, got {value}")
    for name, value in (("activation.situ_beta", cfg.situ_beta), ("activation.situ_linear_beta", cfg.situ_linear_beta),
                        ("attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)):
        if not (math.isfinite(value) and value > 0):  # SiTU divides by the betas
            raise GGUFError(f"{where}: {K.ARCH}.{name} must be finite and > 0, got {value}")
    if not 1 <= cfg.num_experts_used <= cfg.num_experts:
        raise GGUFError(f"{where}: {K.ARCH}.expert_used_count {cfg.num_experts_used} must be in "
                        f"1..expert_count ({cfg.num_experts})")


# ---------------------------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------------------------

def _ne(planned_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(reversed(planned_shape))


def check_tensors(cfg: K3Config, found: Mapping[str, Any], where: str) -> list[PlannedTensor]:
    """Every planned tensor present with its type and shape, nothing else; returns the plan."""
    plan = list(plan_tensors(cfg))
    planned = {p.name for p in plan}
    extra = sorted(set(found) - planned)
    if extra:
        raise GGUFError(f"{where}: {len(extra)} tensor(s) not in the kimi-k3 table for this config, "
                        f"first: {extra[0]!r}")
    present = []
    for p in plan:
        t = found.get(p.name)
        if t is None:
            if p.spec.optional:
                continue
            raise GGUFError(f"{where}: missing tensor {p.name!r} (expected ggml ne {list(_ne(p.shape))})")
        ne = tuple(int(d) for d in t.shape)
        ne = ne + (1,) * (len(p.shape) - len(ne))
        if ne[:len(p.shape)] != _ne(p.shape) or any(d != 1 for d in ne[len(p.shape):]):
            raise GGUFError(f"{where}: tensor {p.name!r} has ggml ne {list(ne)}, expected {list(_ne(p.shape))}")
        allowed = _ALLOWED_TYPES[p.spec.out]
        if t.tensor_type not in allowed:
            raise GGUFError(f"{where}: tensor {p.name!r} has type {t.tensor_type.name}, expected "
                            f"{' or '.join(sorted(q.name for q in allowed))}")
        present.append(p)
    return present


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------

# ggml-python 0.0.45 declares ggml_backend_cpu_buffer_from_ptr with the Python NewType
# `ggml_backend_buffer_t` (an int) as restype, so ctypes truncates the returned pointer to a
# C int and the next use of the buffer segfaults. Bind the same C symbol with a pointer restype.
_cpu_buffer_from_ptr = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes.cast(ggml.lib.ggml_backend_cpu_buffer_from_ptr, ctypes.c_void_p).value)


@dataclass
class _MappedFile:
    """One memory-mapped GGUF file wrapped as a read-only ggml CPU buffer."""

    reader: GGUFReader
    buffer: Any  # ggml_backend_buffer_t

    @classmethod
    def wrap(cls, reader: GGUFReader) -> "_MappedFile":
        mm = reader.data
        base = mm.ctypes.data
        # ggml_backend_cpu_buffer_from_ptr asserts a TENSOR_ALIGNMENT (32) aligned pointer;
        # an mmap base is page aligned, so this only fails on a foreign memmap.
        if base % 32:
            raise GGUFError(f"memory map of {reader.data.filename} is not 32-byte aligned")
        buf = _cpu_buffer_from_ptr(base, mm.nbytes)
        return cls(reader, buf)

    def address(self, data_offset: int) -> int:
        return self.reader.data.ctypes.data + data_offset


@dataclass
class GGUFWeights:
    """A validated kimi-k3 GGUF: the config and a ggml tensor per GGUF tensor, no copies (but
    the repacked experts, with repack=True)."""

    path: Path
    cfg: K3Config
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # GGUF name -> ggml_tensor_p
    _files: list[_MappedFile] = field(repr=False)
    _ctx: Any = field(repr=False)
    _repacked: Repacked | None = field(default=None, repr=False)

    @property
    def repacked(self) -> tuple[str, ...]:
        """Names of the tensors held in ggml's repacked layout (empty: every tensor is mapped)."""
        return tuple(self._repacked.tensors) if self._repacked else ()

    @property
    def repacked_bytes(self) -> int:
        return self._repacked.nbytes if self._repacked else 0

    def layer(self, layer: int) -> "LayerWeights":
        return LayerWeights(self.cfg, layer, self.tensors)

    def close(self) -> None:
        """Free the ggml objects; the tensors must not be used afterwards."""
        for f in self._files:
            ggml.ggml_backend_buffer_free(f.buffer)
        self._files = []
        if self._repacked is not None:
            self._repacked.free()
            self._repacked = None
        if self._ctx is not None:
            ggml.ggml_free(self._ctx)
            self._ctx = None


class LayerWeights:
    """`w(suffix)` is the ggml tensor of `blk.{layer}.{suffix}`, names as in gguf_arch.arch.tensors."""

    def __init__(self, cfg: K3Config, layer: int, tensors: Mapping[str, Any]):
        self.cfg = cfg
        self.layer = layer
        self._tensors = tensors

    def __call__(self, suffix: str) -> Any:
        return self._tensors[f"blk.{self.layer}.{suffix}"]

    def has(self, suffix: str) -> bool:
        return f"blk.{self.layer}.{suffix}" in self._tensors


def _ggml_tensor(ctx, name: str, ggml_type: int, ne: tuple[int, ...]):
    t = ggml.ggml_new_tensor(ctx, ggml_type, len(ne), (ctypes.c_int64 * len(ne))(*ne))
    ggml.ggml_set_name(t, name.encode())
    return t


def _tensor_bytes_in_file(reader: GGUFReader, t, where: str) -> None:
    end = t.data_offset + t.n_bytes
    if end > reader.data.nbytes or t.data_offset % reader.alignment:
        raise GGUFError(f"{where}: tensor {t.name!r} data [{t.data_offset}, {end}) is outside the file "
                        f"({reader.data.nbytes} bytes) or not {reader.alignment}-byte aligned")


def _source(files: list[_MappedFile], found: Mapping[str, tuple[int, Any]], name: str) -> Source:
    i, t = found[name]
    return Source(name, int(t.tensor_type), tuple(int(d) for d in t.shape), files[i].address(t.data_offset),
                  int(t.n_bytes))


Adjust = Callable[[dict[str, Any], K3Config], tuple[dict[str, Any], K3Config]]


def load_gguf(path: Path | str, *, repack: bool = False, adjust: Adjust | None = None) -> GGUFWeights:
    """Open, validate and map a kimi-k3 GGUF (single file or the first file of a split).

    repack: copy the routed experts into ggml's repacked layout (module docstring). adjust:
    (metadata, config) -> (metadata, config), run after every check and before the first ggml
    object, so what it refuses (the runner's --override-kv) never reaches ggml."""
    path = Path(path)
    first = open_gguf(path)
    paths = part_paths(path, first)
    readers = [first] + [open_gguf(p) for p in paths[1:]]
    meta = read_metadata(readers)
    cfg = config_from_metadata(meta, str(path))
    found: dict[str, tuple[int, Any]] = {}
    for i, (p, r) in enumerate(zip(paths, readers)):
        for t in r.tensors:
            if t.name in found:
                raise GGUFError(f"{p}: tensor {t.name!r} appears twice")
            _tensor_bytes_in_file(r, t, str(p))
            found[t.name] = (i, t)
    present = check_tensors(cfg, {n: t for n, (_, t) in found.items()}, str(path))
    if adjust is not None:
        meta, cfg = adjust(meta, cfg)

    files = [_MappedFile.wrap(r) for r in readers]
    try:
        repacked = repack_experts([_source(files, found, p.name) for p in present if p.spec.out == OUT_MXFP4],
                                  str(path)) if repack else None
    except GGUFError:
        for f in files:
            ggml.ggml_backend_buffer_free(f.buffer)
        raise
    mapped = [p for p in present if repacked is None or p.name not in repacked.tensors]
    overhead = ggml.ggml_tensor_overhead() * (len(mapped) + 1)
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=overhead, mem_buffer=None, no_alloc=True))
    tensors = {}
    for p in mapped:
        i, t = found[p.name]
        gt = _ggml_tensor(ctx, p.name, int(t.tensor_type), tuple(int(d) for d in t.shape))
        ggml.ggml_backend_tensor_alloc(files[i].buffer, gt, ctypes.c_void_p(files[i].address(t.data_offset)))
        tensors[p.name] = gt
    if repacked is not None:
        tensors.update(repacked.tensors)
    return GGUFWeights(path, cfg, meta, tensors, files, ctx, repacked)
