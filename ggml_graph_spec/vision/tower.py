"""MoonViT and the patchmergerv2 projector as one ggml graph per media item (the math:
docs/reference/vision.md).

Activations are ggml `[width, patches]` (numpy `[patches, width]`). Per item of grid (t, h, w):

1. patch embedding: the Conv2d as a matmul of `v.patch_embd` viewed `[C, 3*p*p]` with the
   (c, dy, dx)-flattened patches, plus the host's position term (`positions.py`);
2. per block: `x += attn_out(attention(rope(attn_qkv(rms_norm(x) * ln1))))`, then
   `x += ffn_down(gelu_tanh(ffn_up(rms_norm(x) * ln2)))`, RMSNorm eps = float32 machine eps.
   q and k are rotated by the 2D RoPE from the host's angle table: each head's pairs (2j, 2j+1)
   are split into a "real" and an "imaginary" half of head_dim/2 and rotated there, so q and k
   leave in that split order (the same permutation of both keeps every q.k). Attention is full
   (non-causal) over the item's t*h*w patches, softmax(q.k * head_dim^-0.5) in F32 (ggml's
   flash attention, F32 keys and values);
3. the final RMSNorm (`v.post_ln`), then `sd2_tpool`: each k x k group of patches side by side
   in (dy, dx) order, averaged over the frames;
4. the projector: `mm.post_norm(mm.2(gelu_erf(mm.1(x))))`, RMSNorm with the projector's eps.

The exact path (weights F32, `weights.py`) builds the ViT's tanh GELU from elementary ops: ggml's
`ggml_gelu` reads an FP16 table (2e-3 off, a hundred times the reference's noise). The fast path
uses `ggml_gelu` and the weights as stored. The projector's erf GELU is `ggml_gelu_erf` on both.
"""
from __future__ import annotations

import ctypes
import math
from typing import Any

import ggml
import numpy as np

from gguf_arch.arch.mmproj import (MM_1, MM_2, MM_POST_NORM, V_ATTN_OUT, V_ATTN_QKV, V_FFN_DOWN, V_FFN_UP, V_LN1,
                                   V_LN2, V_PATCH_EMBD, V_POST_LN)
from gguf_arch.arch.tensors import layer_name
from gguf_arch.arch.vision import VIT_NORM_EPS, VisionConfig

from .positions import position_term, rope_angles
from .weights import VisionWeights

F32 = ggml.GGML_TYPE_F32
GELU_TANH_BETA = math.sqrt(2.0 / math.pi)
GELU_TANH_KAPPA = 0.044715
# The stages a caller may ask to see, in graph order (the reference fixture's names).
STAGES = ("patch_embed", "final_norm", "merged_flat", "image_features")


def block_stage(block: int) -> str:
    return f"block{block}"


class VisionGraph:
    """One item's graph under construction: its inputs (uploaded before compute) and the stages kept."""

    def __init__(self, ctx, gf, weights: VisionWeights, taps: bool) -> None:
        self.ctx, self.gf, self.w, self.cfg = ctx, gf, weights, weights.cfg
        self.taps = taps
        self.inputs: list[tuple[Any, np.ndarray]] = []
        self.records: dict[str, Any] = {}

    def input(self, name: str, value: np.ndarray):
        """An F32 input of numpy shape `value.shape` (ggml ne reversed)."""
        value = np.ascontiguousarray(value, dtype=np.float32)
        ne = tuple(reversed(value.shape))
        t = ggml.ggml_new_tensor(self.ctx, F32, len(ne), (ctypes.c_int64 * len(ne))(*ne))
        ggml.ggml_set_name(t, name.encode())
        ggml.ggml_set_input(t)
        self.inputs.append((t, value))
        return t

    def record(self, stage: str, t) -> None:
        if not self.taps:
            return
        if not ggml.ggml_is_contiguous(t):
            t = ggml.ggml_cont(self.ctx, t)
        ggml.ggml_set_output(t)
        ggml.ggml_build_forward_expand(self.gf, t)
        self.records[stage] = t

    def weight(self, template: str, block: int | None = None):
        return self.w.tensors[template if block is None else layer_name(template, block)]

    def rms_norm(self, x, weight, eps: float):
        return ggml.ggml_mul(self.ctx, ggml.ggml_rms_norm(self.ctx, x, eps), weight)


def gelu_tanh(g: VisionGraph, x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) from F32 ops; ggml_gelu (a table) off the exact path."""
    ctx = g.ctx
    if not g.w.exact:
        return ggml.ggml_gelu(ctx, x)
    cube = ggml.ggml_mul(ctx, ggml.ggml_mul(ctx, x, x), x)
    inner = ggml.ggml_scale(ctx, ggml.ggml_add(ctx, x, ggml.ggml_scale(ctx, cube, GELU_TANH_KAPPA)), GELU_TANH_BETA)
    return ggml.ggml_mul(ctx, ggml.ggml_scale(ctx, x, 0.5), ggml.ggml_scale_bias(ctx, ggml.ggml_tanh(ctx, inner), 1.0, 1.0))


def rotated(g: VisionGraph, qkv, part: int, cos, sin, n_patches: int):
    """q (part 0) or k (part 1) of qkv [3Q, L], RoPE applied, as [head_dim, L, heads] in split order
    (contiguous per head: the attention's matmul reads it as it is)."""
    ctx, cfg = g.ctx, g.cfg
    hd, heads, row = cfg.head_dim, cfg.num_heads, qkv.contents.nb[1]
    pairs = ggml.ggml_view_4d(ctx, qkv, 2, hd // 2, heads, n_patches, 8, hd * 4, row, part * cfg.qkv_size * 4)
    split = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, pairs, 1, 0, 3, 2))  # [hd/2, 2, L, heads]
    nb1, nb2 = split.contents.nb[2], split.contents.nb[3]
    re = ggml.ggml_view_3d(ctx, split, hd // 2, n_patches, heads, nb1, nb2, 0)
    im = ggml.ggml_view_3d(ctx, split, hd // 2, n_patches, heads, nb1, nb2, hd // 2 * 4)
    out_re = ggml.ggml_sub(ctx, ggml.ggml_mul(ctx, re, cos), ggml.ggml_mul(ctx, im, sin))
    out_im = ggml.ggml_add(ctx, ggml.ggml_mul(ctx, re, sin), ggml.ggml_mul(ctx, im, cos))
    return ggml.ggml_concat(ctx, out_re, out_im, 0)


def attention(g: VisionGraph, qkv, cos, sin, n_patches: int):
    """softmax(q.k / sqrt(head_dim)) v over every patch of the item, as ggml's flash attention
    with F32 keys and values (F32 dot products and accumulation: within the reference's float32
    noise; no L x L score matrix, which a 4096-patch image would make 0.8 GB): [Q, L]."""
    ctx, cfg = g.ctx, g.cfg
    hd, heads = cfg.head_dim, cfg.num_heads
    q, k = rotated(g, qkv, 0, cos, sin, n_patches), rotated(g, qkv, 1, cos, sin, n_patches)  # [hd, L, heads]
    v = ggml.ggml_view_3d(ctx, qkv, hd, n_patches, heads, qkv.contents.nb[1], hd * 4, 2 * cfg.qkv_size * 4)
    out = ggml.ggml_flash_attn_ext(ctx, q, k, v, None, 1.0 / math.sqrt(hd), 0.0, 0.0)
    ggml.ggml_flash_attn_ext_set_prec(out, ggml.GGML_PREC_F32)
    return ggml.ggml_reshape_2d(ctx, out, cfg.qkv_size, n_patches)  # [hd, heads, L]: already per patch


def encoder_block(g: VisionGraph, block: int, x, cos, sin, n_patches: int):
    ctx = g.ctx
    h = g.rms_norm(x, g.weight(V_LN1, block), VIT_NORM_EPS)
    qkv = ggml.ggml_mul_mat(ctx, g.weight(V_ATTN_QKV, block), h)
    x = ggml.ggml_add(ctx, x, ggml.ggml_mul_mat(ctx, g.weight(V_ATTN_OUT, block), attention(g, qkv, cos, sin, n_patches)))
    h = g.rms_norm(x, g.weight(V_LN2, block), VIT_NORM_EPS)
    up = gelu_tanh(g, ggml.ggml_mul_mat(ctx, g.weight(V_FFN_UP, block), h))
    return ggml.ggml_add(ctx, x, ggml.ggml_mul_mat(ctx, g.weight(V_FFN_DOWN, block), up))


def patch_embedding(g: VisionGraph, pixel_values: np.ndarray, grid: tuple[int, int, int]):
    """conv(patches) + position term: [C, L]."""
    ctx, cfg = g.ctx, g.cfg
    n = pixel_values.shape[0]
    patches = g.input("patches", pixel_values.reshape(n, -1))
    w = g.weight(V_PATCH_EMBD)
    conv = ggml.ggml_mul_mat(ctx, ggml.ggml_reshape_2d(ctx, w, ggml.ggml_nelements(w) // cfg.hidden_size,
                                                        cfg.hidden_size), patches)
    return ggml.ggml_add(ctx, conv, g.input("pos", position_term(g.w.pos_table, grid)))


def merge(g: VisionGraph, x, grid: tuple[int, int, int]):
    """sd2_tpool: [C, t*h*w] -> [k*k*C, (h/k)*(w/k)], each token's patches in (dy, dx) order, mean over t."""
    ctx, c, k = g.ctx, g.cfg.hidden_size, g.cfg.merge_kernel
    t, h, w = grid
    groups = ggml.ggml_reshape_4d(ctx, x, c * k, w // k, k, (h // k) * t)  # [(c, dx), j, dy, (i, f)]
    tokens = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, groups, 0, 2, 1, 3))  # [(c, dx), dy, j, (i, f)]
    n = (h // k) * (w // k)
    frames = ggml.ggml_reshape_3d(ctx, tokens, c * k * k, n, t)
    frame = lambda f: ggml.ggml_view_2d(ctx, frames, c * k * k, n, frames.contents.nb[1], f * frames.contents.nb[2])  # noqa: E731
    total = frame(0)
    for f in range(1, t):
        total = ggml.ggml_add(ctx, total, frame(f))
    return ggml.ggml_scale(ctx, total, 1.0 / t) if t > 1 else ggml.ggml_cont(ctx, total)


def projector(g: VisionGraph, x):
    ctx = g.ctx
    y = ggml.ggml_gelu_erf(ctx, ggml.ggml_mul_mat(ctx, g.weight(MM_1), x))
    return g.rms_norm(ggml.ggml_mul_mat(ctx, g.weight(MM_2), y), g.weight(MM_POST_NORM), g.cfg.projector_eps)


def build_tower(g: VisionGraph, pixel_values: np.ndarray, grid: tuple[int, int, int]):
    """The whole item: patches [L, 3, p, p] -> image features [D_text, N]."""
    cfg: VisionConfig = g.cfg
    n = pixel_values.shape[0]
    x = patch_embedding(g, pixel_values, grid)
    g.record("patch_embed", x)
    cos_table, sin_table = rope_angles(grid, cfg.head_dim)
    cos = g.input("rope_cos", cos_table)  # [hd/2, L]: the same for every head
    sin = g.input("rope_sin", sin_table)
    for block in range(cfg.num_layers):
        x = encoder_block(g, block, x, cos, sin, n)
        g.record(block_stage(block), x)
    x = g.rms_norm(x, g.weight(V_POST_LN), VIT_NORM_EPS)
    g.record("final_norm", x)
    merged = merge(g, x, grid)
    g.record("merged_flat", merged)
    return projector(g, merged)
