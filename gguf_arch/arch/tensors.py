"""Every tensor of Kimi K3 / K3.1-Pro, per layer kind, as one table.

Each row says where a GGUF tensor comes from (HF source names and shapes), what it becomes (GGUF
name, logical shape in numpy order, output type) and which transform turns one into the other
(`transforms.py`). The converter, the tensor diff, the graph loader and the tests all read this
table; nothing else spells a tensor name.

Shapes: HF shapes are torch `[out, in]`; GGUF shapes are numpy order (ggml `ne` reversed), in
elements, also for MXFP4 (the writer turns them into bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Callable, Iterator

from .config import K3Config

# ---- GGUF tensor names (as gguf-py's MODEL_TENSOR): the globals whole, the per-layer ones
# with "{l}" for the layer (`layer_name`). The table below and every reader use these names.
LAYER = "blk.{l}."

TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"
OUTPUT_NORM = "output_norm.weight"
OUTPUT_RES_SCORE = "output_res_score.weight"
ATTN_NORM = LAYER + "attn_norm.weight"
FFN_NORM = LAYER + "ffn_norm.weight"
ATTN_RES_SCORE = LAYER + "attn_res_score.weight"
FFN_RES_SCORE = LAYER + "ffn_res_score.weight"
ATTN_Q = LAYER + "attn_q.weight"
ATTN_K = LAYER + "attn_k.weight"
ATTN_V = LAYER + "attn_v.weight"
SSM_F_A = LAYER + "ssm_f_a.weight"
SSM_F_B = LAYER + "ssm_f_b.weight"
SSM_BETA = LAYER + "ssm_beta.weight"
SSM_A = LAYER + "ssm_a"
SSM_DT = LAYER + "ssm_dt.bias"
SSM_G = LAYER + "ssm_g.weight"
SSM_NORM = LAYER + "ssm_norm.weight"
ATTN_OUTPUT = LAYER + "attn_output.weight"
ATTN_Q_A = LAYER + "attn_q_a.weight"
ATTN_Q_A_NORM = LAYER + "attn_q_a_norm.weight"
ATTN_Q_B = LAYER + "attn_q_b.weight"
ATTN_KV_A_MQA = LAYER + "attn_kv_a_mqa.weight"
ATTN_KV_A_NORM = LAYER + "attn_kv_a_norm.weight"
ATTN_K_B = LAYER + "attn_k_b.weight"
ATTN_V_B = LAYER + "attn_v_b.weight"
ATTN_GATE = LAYER + "attn_gate.weight"
INDEXER_Q_B = LAYER + "indexer.attn_q_b.weight"
INDEXER_K = LAYER + "indexer.attn_k.weight"
INDEXER_PROJ = LAYER + "indexer.proj.weight"
INDEXER_K_NORM = LAYER + "indexer.k_norm.weight"
INDEXER_K_NORM_BIAS = LAYER + "indexer.k_norm.bias"
FFN_GATE = LAYER + "ffn_gate.weight"
FFN_UP = LAYER + "ffn_up.weight"
FFN_DOWN = LAYER + "ffn_down.weight"
FFN_GATE_INP = LAYER + "ffn_gate_inp.weight"
EXP_PROBS_B = LAYER + "exp_probs_b.bias"
FFN_ROUTED_DOWN = LAYER + "ffn_routed_down.weight"
FFN_ROUTED_UP = LAYER + "ffn_routed_up.weight"
FFN_ROUTED_NORM = LAYER + "ffn_routed_norm.weight"
FFN_GATE_SHEXP = LAYER + "ffn_gate_shexp.weight"
FFN_UP_SHEXP = LAYER + "ffn_up_shexp.weight"
FFN_DOWN_SHEXP = LAYER + "ffn_down_shexp.weight"
FFN_GATE_EXPS = LAYER + "ffn_gate_exps.weight"
FFN_UP_EXPS = LAYER + "ffn_up_exps.weight"
FFN_DOWN_EXPS = LAYER + "ffn_down_exps.weight"
SSM_CONV1D = {x: LAYER + f"ssm_conv1d_{x}.weight" for x in "qkv"}  # q, k, v short convolutions


def layer_name(template: str, layer: int) -> str:
    """The GGUF name of a per-layer tensor in `layer`."""
    return template.format(l=layer)


_LAYER_PREFIX = LAYER.split("{l}")[0]  # "blk."


def gguf_layer(name: str) -> int | None:
    """The layer a GGUF tensor name belongs to, None for a global."""
    if not name.startswith(_LAYER_PREFIX):
        return None
    head = name[len(_LAYER_PREFIX):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def gguf_kind(name: str) -> str:
    """What a layer's GGUF tensor is, its name between the layer and the suffix (`ffn_gate_exps`
    of `blk.3.ffn_gate_exps.weight`); "" for a global."""
    return name.split(".")[2] if gguf_layer(name) is not None and name.count(".") >= 2 else ""


TEXT_PREFIX = "language_model."
# Tensors a text converter deliberately leaves out: the vision tower and its projector.
SKIP_PREFIXES = ("vision_tower.", "mm_projector.")
# The two halves of a compressed-tensors MXFP4 weight (the routed experts' only).
MXFP4_SUFFIXES = (".weight_packed", ".weight_scale")

FLOAT = frozenset({"BF16", "F16", "F32"})
U8 = frozenset({"U8"})

# Output types: "source" keeps the checkpoint's precision (bf16 stays bf16).
OUT_SOURCE = "source"
OUT_F32 = "F32"
OUT_MXFP4 = "MXFP4"

Shape = Callable[[K3Config], tuple]


@dataclass(frozen=True)
class Source:
    name: str  # after TEXT_PREFIX; may contain {l} and {e}
    shape: Shape
    dtypes: frozenset  # what the converter accepts
    # What the released K3 checkpoint stores (docs/reference/tensors.md#byte-accounting: five f32
    # families, u8 experts, the rest bf16); the synthetic checkpoints write it and listings without
    # shards assume it.
    stored: str = "BF16"


@dataclass(frozen=True)
class TensorSpec:
    group: str  # which layers carry it: global, layer, kda, mla, dsa, dense, moe
    gguf: str  # may contain {l}
    sources: tuple[Source, ...]
    shape: Shape  # GGUF logical shape, numpy order
    out: str  # OUT_SOURCE, OUT_F32 or OUT_MXFP4
    transform: str = "copy"
    optional: bool = False  # absent in the checkpoint -> not written


def _src(name: str, shape: Shape, dtypes: frozenset = FLOAT, stored: str = "BF16") -> Source:
    return Source(name, shape, dtypes, stored)


def _row(group: str, gguf: str, hf: str, hf_shape: Shape, out: str = OUT_SOURCE,
         shape: Shape | None = None, transform: str = "copy", optional: bool = False,
         stored: str = "BF16") -> TensorSpec:
    """One source -> one output; the output shape defaults to the source shape."""
    return TensorSpec(group, gguf, (_src(hf, hf_shape, stored=stored),), shape or hf_shape, out, transform, optional)


def _res_score(group: str, gguf: str, norm: str, proj: str) -> TensorSpec:
    """AttnRes: RMSNorm gain x pseudo-query, fused into one f32 score vector."""
    return TensorSpec(group, gguf, (_src(norm, lambda c: (c.hidden_size,)),
                                    _src(proj, lambda c: (1, c.hidden_size))),
                      lambda c: (c.hidden_size,), OUT_F32, "res_score")


def _experts(gguf: str, w: str, rows: Callable[[K3Config], int], cols: Callable[[K3Config], int]) -> TensorSpec:
    """Routed experts: compressed-tensors MXFP4 pairs stacked into one [n_expert, rows, cols]."""
    base = f"model.layers.{{l}}.block_sparse_moe.experts.{{e}}.{w}"
    packed, scale = MXFP4_SUFFIXES
    return TensorSpec(
        "moe", gguf,
        (_src(base + packed, lambda c: (rows(c), cols(c) // 2), U8, "U8"),
         _src(base + scale, lambda c: (rows(c), cols(c) // c.mxfp4_group_size), U8, "U8")),
        lambda c: (c.num_experts, rows(c), cols(c)), OUT_MXFP4, "mxfp4_experts")


_L = "model.layers.{l}."
_A = _L + "self_attn."
_M = _L + "block_sparse_moe."

_H = lambda c: c.hidden_size  # noqa: E731 - short shape helpers read like the spec's symbols
_P = lambda c: c.kda.proj_dim  # noqa: E731
_HD = lambda c: c.kda.head_dim  # noqa: E731
_VEC_H = lambda c: (c.hidden_size,)  # noqa: E731

TABLE: tuple[TensorSpec, ...] = (
    # ---- globals ---------------------------------------------------------------------------
    _row("global", TOKEN_EMBD, "model.embed_tokens.weight", lambda c: (c.vocab_size, _H(c))),
    _row("global", OUTPUT, "lm_head.weight", lambda c: (c.vocab_size, _H(c))),
    _row("global", OUTPUT_NORM, "model.norm.weight", _VEC_H, OUT_F32),
    _res_score("global", OUTPUT_RES_SCORE, "model.output_attn_res_norm.weight",
               "model.output_attn_res_proj.weight"),
    # ---- every layer -----------------------------------------------------------------------
    _row("layer", ATTN_NORM, _L + "input_layernorm.weight", _VEC_H, OUT_F32),
    _row("layer", FFN_NORM, _L + "post_attention_layernorm.weight", _VEC_H, OUT_F32),
    _res_score("layer", ATTN_RES_SCORE, _L + "self_attention_res_norm.weight",
               _L + "self_attention_res_proj.weight"),
    _res_score("layer", FFN_RES_SCORE, _L + "mlp_res_norm.weight", _L + "mlp_res_proj.weight"),
    # ---- KDA attention -----------------------------------------------------------------------
    _row("kda", ATTN_Q, _A + "q_proj.weight", lambda c: (_P(c), _H(c))),
    _row("kda", ATTN_K, _A + "k_proj.weight", lambda c: (_P(c), _H(c))),
    _row("kda", ATTN_V, _A + "v_proj.weight", lambda c: (_P(c), _H(c))),
    *(_row("kda", SSM_CONV1D[x], _A + f"{x}_conv1d.weight",
           lambda c: (_P(c), 1, c.kda.conv_kernel), OUT_F32,
           shape=lambda c: (1, _P(c), 1, c.kda.conv_kernel), transform="reshape", stored="F32") for x in "qkv"),
    _row("kda", SSM_F_A, _A + "f_a_proj.weight", lambda c: (_HD(c), _H(c))),
    _row("kda", SSM_F_B, _A + "f_b_proj.weight", lambda c: (_P(c), _HD(c))),
    _row("kda", SSM_BETA, _A + "b_proj.weight", lambda c: (c.kda.num_heads, _H(c))),
    # A_log is stored [head_dim]: the per-head log-scales first, then zero padding.
    _row("kda", SSM_A, _A + "A_log", lambda c: (_HD(c),), OUT_F32,
         shape=lambda c: (c.kda.num_heads,), transform="neg_exp_heads", stored="F32"),
    _row("kda", SSM_DT, _A + "dt_bias", lambda c: (_P(c),), OUT_F32, stored="F32"),
    _row("kda", SSM_G, _A + "g_proj.weight", lambda c: (_P(c), _H(c))),
    _row("kda", SSM_NORM, _A + "o_norm.weight", lambda c: (_HD(c),), OUT_F32, stored="F32"),
    _row("kda", ATTN_OUTPUT, _A + "o_proj.weight", lambda c: (_H(c), _P(c))),
    # ---- gated NoPE MLA ----------------------------------------------------------------------
    _row("mla", ATTN_Q_A, _A + "q_a_proj.weight", lambda c: (c.q_lora_rank, _H(c))),
    _row("mla", ATTN_Q_A_NORM, _A + "q_a_layernorm.weight", lambda c: (c.q_lora_rank,), OUT_F32),
    _row("mla", ATTN_Q_B, _A + "q_b_proj.weight",
         lambda c: (c.num_heads * c.qk_head_dim, c.q_lora_rank)),
    _row("mla", ATTN_KV_A_MQA, _A + "kv_a_proj_with_mqa.weight",
         lambda c: (c.kv_lora_rank + c.qk_rope_head_dim, _H(c))),
    _row("mla", ATTN_KV_A_NORM, _A + "kv_a_layernorm.weight", lambda c: (c.kv_lora_rank,), OUT_F32),
    # kv_b is split into the absorbed halves; k_b is transposed so the latent is its rows.
    _row("mla", ATTN_K_B, _A + "kv_b_proj.weight",
         lambda c: (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
         shape=lambda c: (c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim), transform="kv_b_k"),
    _row("mla", ATTN_V_B, _A + "kv_b_proj.weight",
         lambda c: (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
         shape=lambda c: (c.num_heads, c.v_head_dim, c.kv_lora_rank), transform="kv_b_v"),
    _row("mla", ATTN_GATE, _A + "g_proj.weight", lambda c: (c.num_heads * c.v_head_dim, _H(c))),
    _row("mla", ATTN_OUTPUT, _A + "o_proj.weight", lambda c: (_H(c), c.num_heads * c.v_head_dim)),
    # ---- K3.1-Pro lightning indexer (docs/reference/gguf.md#indexer-tensors) -------------
    _row("dsa", INDEXER_Q_B, _A + "indexer.wq_b.weight",
         lambda c: (c.indexer.n_heads * c.indexer.head_dim, c.q_lora_rank)),
    _row("dsa", INDEXER_K, _A + "indexer.wk.weight", lambda c: (c.indexer.head_dim, _H(c))),
    _row("dsa", INDEXER_PROJ, _A + "indexer.weights_proj.weight",
         lambda c: (c.indexer.n_heads, _H(c)), OUT_F32),
    _row("dsa", INDEXER_K_NORM, _A + "indexer.k_norm.weight", lambda c: (c.indexer.head_dim,), OUT_F32),
    _row("dsa", INDEXER_K_NORM_BIAS, _A + "indexer.k_norm.bias", lambda c: (c.indexer.head_dim,), OUT_F32,
         optional=True),
    # ---- dense FFN (the first first_k_dense_replace layers) ----------------------------------
    _row("dense", FFN_GATE, _L + "mlp.gate_proj.weight", lambda c: (c.intermediate_size, _H(c))),
    _row("dense", FFN_UP, _L + "mlp.up_proj.weight", lambda c: (c.intermediate_size, _H(c))),
    _row("dense", FFN_DOWN, _L + "mlp.down_proj.weight", lambda c: (_H(c), c.intermediate_size)),
    # ---- LatentMoE ---------------------------------------------------------------------------
    _row("moe", FFN_GATE_INP, _M + "gate.weight", lambda c: (c.num_experts, _H(c)), OUT_F32),
    _row("moe", EXP_PROBS_B, _M + "gate.e_score_correction_bias", lambda c: (c.num_experts,), OUT_F32,
         stored="F32"),
    _row("moe", FFN_ROUTED_DOWN, _M + "routed_expert_down_proj.weight", lambda c: (c.latent_size, _H(c))),
    _row("moe", FFN_ROUTED_UP, _M + "routed_expert_up_proj.weight", lambda c: (_H(c), c.latent_size)),
    _row("moe", FFN_ROUTED_NORM, _M + "routed_expert_norm.weight", lambda c: (c.latent_size,), OUT_F32),
    _row("moe", FFN_GATE_SHEXP, _M + "shared_experts.gate_proj.weight", lambda c: (c.shared_size, _H(c))),
    _row("moe", FFN_UP_SHEXP, _M + "shared_experts.up_proj.weight", lambda c: (c.shared_size, _H(c))),
    _row("moe", FFN_DOWN_SHEXP, _M + "shared_experts.down_proj.weight", lambda c: (_H(c), c.shared_size)),
    _experts(FFN_GATE_EXPS, "w1", lambda c: c.moe_intermediate_size, lambda c: c.latent_size),
    _experts(FFN_UP_EXPS, "w3", lambda c: c.moe_intermediate_size, lambda c: c.latent_size),
    _experts(FFN_DOWN_EXPS, "w2", lambda c: c.latent_size, lambda c: c.moe_intermediate_size),
)


# The routed experts (stacked [n_expert, rows, cols]), and with the router's rows and bias every
# tensor whose first axis (numpy order; the outermost ggml one) is the routed expert: what expert
# pruning slices (ggml_graph_spec/tools/prune.py), each expert one contiguous run of bytes.
ROUTED_EXPERTS = (FFN_GATE_EXPS, FFN_UP_EXPS, FFN_DOWN_EXPS)
PER_EXPERT = (FFN_GATE_INP, EXP_PROBS_B, *ROUTED_EXPERTS)


def layer_groups(cfg: K3Config, layer: int) -> tuple[str, ...]:
    """The table groups a layer carries, decided by the config's layer kinds."""
    groups = ["layer", cfg.attn_kind(layer)]
    if cfg.is_dsa(layer):
        groups.append("dsa")
    groups.append(cfg.ffn_kind(layer))
    return tuple(groups)


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor with its concrete names and shapes for a given config."""

    spec: TensorSpec
    layer: int | None
    name: str  # GGUF name
    shape: tuple[int, ...]  # GGUF logical shape, numpy order
    sources: Sequence[tuple[str, tuple[int, ...]]]  # (full HF name, expected shape), in spec order

    @property
    def transform(self) -> str:
        return self.spec.transform


class SourceList(Sequence):
    """A row's sources for one layer, expert by expert, each name made when asked for: a config
    with a million experts costs nothing until its names are read (the loader and the layout
    check read only names and shapes of the outputs; the plan first compares the counts)."""

    def __init__(self, spec: TensorSpec, cfg: K3Config, fmt: dict) -> None:
        self._spec, self._cfg, self._fmt = spec, cfg, fmt
        self._experts = cfg.num_experts if "{e}" in spec.sources[0].name else 0

    def __len__(self) -> int:
        return max(1, self._experts) * len(self._spec.sources)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        e, k = divmod(i % len(self), len(self._spec.sources))
        s = self._spec.sources[k]
        name = TEXT_PREFIX + s.name.format(**self._fmt, **({"e": e} if self._experts else {}))
        return name, tuple(s.shape(self._cfg))


def _expand(spec: TensorSpec, cfg: K3Config, layer: int | None) -> PlannedTensor:
    fmt = {} if layer is None else {"l": layer}
    return PlannedTensor(spec, layer, spec.gguf.format(**fmt), tuple(spec.shape(cfg)), SourceList(spec, cfg, fmt))


def plan_tensors(cfg: K3Config) -> Iterator[PlannedTensor]:
    """Every output tensor in file order: globals first, then layer by layer in table order."""
    for spec in TABLE:
        if spec.group == "global":
            yield _expand(spec, cfg, None)
    for layer in range(cfg.num_layers):
        groups = layer_groups(cfg, layer)
        for spec in TABLE:
            if spec.group in groups:
                yield _expand(spec, cfg, layer)


def specs_by_gguf_template() -> dict[str, TensorSpec]:
    return {s.gguf: s for s in TABLE}


def is_skipped(hf_name: str) -> bool:
    """Deliberately not converted (text-only conversion)."""
    return hf_name.startswith(SKIP_PREFIXES)
