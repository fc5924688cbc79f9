"""Numpy references (float64) of the gated NoPE MLA (docs/reference/forward.md#mla, the un-absorbed
form, so the graph's absorbed form is checked against the reference's own) and of the K3.1-Pro
indexer and its selection (docs/reference/dsa.md#indexer-math), on weights in GGUF layout (numpy
order of gguf_arch's table)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from gguf_arch.arch.config import IndexerConfig, K3Config
from gguf_arch.arch.tensors import plan_tensors

LATENT_EPS = 1e-6  # q_a / kv_a RMSNorm (Moonshot's default)
KEY_EPS = 1e-6  # indexer key LayerNorm


def odd_sized(cfg: K3Config) -> K3Config:
    """The fixture's config with every attention size distinct, so a swapped axis cannot pass."""
    return replace(cfg, hidden_size=24, num_heads=3, q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=6,
                   qk_rope_head_dim=5, v_head_dim=7,
                   indexer=IndexerConfig(n_heads=2, head_dim=9, top_k=cfg.indexer.top_k, layers=cfg.indexer.layers))


def random_attention_weights(cfg: K3Config, layer: int, rng: np.random.Generator,
                             key_bias: bool = False) -> dict[str, np.ndarray]:
    """F32 weights of one MLA (+ indexer) layer, keyed by GGUF name without `blk.{l}.`."""
    prefix = f"blk.{layer}."
    out = {}
    for t in plan_tensors(cfg):
        if t.layer != layer or t.spec.group not in ("mla", "dsa"):
            continue
        if t.spec.optional and not key_bias:
            continue
        name = t.name[len(prefix):]
        if len(t.shape) == 1:  # norm gains and the key bias
            a = (0.0 if name.endswith(".bias") else 1.0) + 0.2 * rng.standard_normal(t.shape)
        else:
            a = rng.standard_normal(t.shape) * t.shape[-1] ** -0.5
        out[name] = a.astype(np.float32)
    return out


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def q_lora_latent(W: dict, x: np.ndarray, eps: float = LATENT_EPS) -> np.ndarray:
    return _rms(x @ W["attn_q_a.weight"].T.astype(np.float64), W["attn_q_a_norm.weight"], eps)


def mla(cfg: K3Config, W: dict, x: np.ndarray, mask: np.ndarray, latent_eps: float = LATENT_EPS) -> np.ndarray:
    """docs/reference/forward.md#mla for one sequence whose cache holds exactly the rows of x:
    x [T, n_embd], mask [T, T] (0 / -inf, added after the scale) -> [T, n_embd]. latent_eps: the
    q_a / kv_a norms'."""
    W = {k: v.astype(np.float64) for k, v in W.items()}
    x = x.astype(np.float64)
    T, H, nope, v_dim, r = x.shape[0], cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q = (q_lora_latent(W, x, latent_eps) @ W["attn_q_b.weight"].T).reshape(T, H, nope + cfg.qk_rope_head_dim)
    ckv = x @ W["attn_kv_a_mqa.weight"].T
    c, k_pe = _rms(ckv[:, :r], W["attn_kv_a_norm.weight"], latent_eps), ckv[:, r:]
    w_kb = W["attn_k_b.weight"].transpose(0, 2, 1)  # GGUF (H, kv_lora, nope) -> HF (H, nope, kv_lora)
    k_nope = np.einsum("hnl,tl->thn", w_kb, c)
    v = np.einsum("hvl,tl->thv", W["attn_v_b.weight"], c)
    K = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None, :], (T, H, k_pe.shape[1]))], -1)
    s = np.einsum("thd,shd->hts", q, K) * (nope + cfg.qk_rope_head_dim) ** -0.5 + mask[None]
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hts,shv->thv", p, v).reshape(T, H * v_dim)
    o = o / (1.0 + np.exp(-(x @ W["attn_gate.weight"].T)))
    return o @ W["attn_output.weight"].T


def indexer_scores(cfg: K3Config, W: dict, x: np.ndarray) -> np.ndarray:
    """Contract section 3: score [T, T], -inf above the diagonal."""
    W = {k: v.astype(np.float64) for k, v in W.items()}
    x = x.astype(np.float64)
    ix, T = cfg.indexer, x.shape[0]
    qI = (q_lora_latent(W, x) @ W["indexer.attn_q_b.weight"].T).reshape(T, ix.n_heads, ix.head_dim)
    k = x @ W["indexer.attn_k.weight"].T
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + KEY_EPS)
    kI = k * W["indexer.k_norm.weight"] + W.get("indexer.k_norm.bias", 0.0)
    w = (x @ W["indexer.proj.weight"].T) * ix.n_heads ** -0.5 * ix.head_dim ** -0.5
    score = np.einsum("th,tsh->ts", w, np.maximum(np.einsum("thd,sd->tsh", qI, kI), 0.0))
    return np.where(np.tril(np.ones((T, T), bool)), score, -np.inf)


def select(scores: np.ndarray, top_k: int, n_past: int = 0) -> list[np.ndarray]:
    """Per query t (at position n_past + t): the min(top_k, visible) visible positions with the
    highest scores, ties -> lower position (a stable sort of the negated scores), ascending."""
    out = []
    for t, row in enumerate(scores):
        visible = n_past + t + 1
        order = np.argsort(-row[:visible], kind="stable")
        out.append(np.sort(order[: min(top_k, visible)]))
    return out


def selection_mask(selected: list[np.ndarray], n_kv: int) -> np.ndarray:
    m = np.full((len(selected), n_kv), -np.inf)
    for t, s in enumerate(selected):
        m[t, s] = 0.0
    return m
