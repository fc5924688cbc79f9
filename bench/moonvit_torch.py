"""The bench's PyTorch MoonViT: Kimi K3's vision tower and projector written here from the math
(docs/reference/vision.md), float32, for bench/vision.py to time against the ggml graph. Not Moonshot's
code: plain torch ops, the attention through torch's scaled_dot_product_attention.

Input: the processor's patches [L, 3, p, p] (float32) and the grid (t, h, w); output: the rows
[N, D_text]. Weights: the checkpoint's tensors by their checkpoint names, as float32 tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

EPS_VIT = torch.finfo(torch.float32).eps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class MoonViT:
    def __init__(self, weights: dict[str, torch.Tensor], vision: dict, projector_eps: float) -> None:
        self.w, self.v, self.projector_eps = weights, vision, projector_eps
        self.heads = vision["vt_num_attention_heads"]
        self.head_dim = vision["qkv_hidden_size"] // self.heads

    def position(self, grid: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid
        table = self.w["vision_tower.patch_embed.pos_emb.weight"]  # [H0, W0, C]
        if table.shape[:2] != (h, w):
            table = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear",
                                  align_corners=False)[0].permute(1, 2, 0)
        pos = table.reshape(h * w, -1).repeat(t, 1)
        if t > 1:
            c = table.shape[-1]
            omega = 1.0 / 10000.0 ** (torch.arange(c // 2, dtype=torch.float32) / (c / 2))
            angles = torch.arange(t, dtype=torch.float32)[:, None] * omega[None]
            time = torch.cat([angles.sin(), angles.cos()], dim=1)
            pos = pos + time.repeat_interleave(h * w, dim=0)
        return pos

    def rope(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """complex64 [L, head_dim/2]: pair j turns by col (j even) or row (j odd) x 10000^(-4 floor(j/2)/hd)."""
        t, h, w = grid
        freqs = 1.0 / 10000.0 ** (torch.arange(0, self.head_dim, 4, dtype=torch.float32) / self.head_dim)
        rows, cols = torch.div(torch.arange(h * w), w, rounding_mode="floor"), torch.arange(h * w) % w
        angles = torch.stack([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1).reshape(h * w, -1)
        return torch.polar(torch.ones_like(angles), angles).repeat(t, 1)

    def block(self, x: torch.Tensor, i: int, cis: torch.Tensor) -> torch.Tensor:
        pre = f"vision_tower.encoder.blocks.{i}."
        n = x.shape[0]
        qkv = (rms_norm(x, self.w[pre + "norm0.weight"], EPS_VIT) @ self.w[pre + "wqkv.weight"].T)
        q, k, v = qkv.view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = (torch.view_as_real(torch.view_as_complex(a.reshape(n, self.heads, -1, 2)) * cis[:, None]).reshape(
            n, self.heads, self.head_dim) for a in (q, k))
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + attn.transpose(0, 1).reshape(n, -1) @ self.w[pre + "wo.weight"].T
        h = rms_norm(x, self.w[pre + "norm1.weight"], EPS_VIT) @ self.w[pre + "mlp.fc0.weight"].T
        return x + F.gelu(h, approximate="tanh") @ self.w[pre + "mlp.fc1.weight"].T

    def merge(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid
        k = self.v["merge_kernel_size"][0]
        x = x.view(t, h // k, k, w // k, k, -1).permute(0, 1, 3, 2, 4, 5).mean(dim=0)
        return x.reshape((h // k) * (w // k), -1)

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        conv = self.w["vision_tower.patch_embed.proj.weight"]
        x = pixel_values.reshape(pixel_values.shape[0], -1) @ conv.reshape(conv.shape[0], -1).T + self.position(grid)
        cis = self.rope(grid)
        for i in range(self.v["vt_num_hidden_layers"]):
            x = self.block(x, i, cis)
        x = self.merge(rms_norm(x, self.w["vision_tower.encoder.final_layernorm.weight"], EPS_VIT), grid)
        y = F.gelu(x @ self.w["mm_projector.proj.0.weight"].T) @ self.w["mm_projector.proj.2.weight"].T
        return rms_norm(y, self.w["mm_projector.post_norm.weight"], self.projector_eps)

