"""The mmproj GGUF of Kimi K3's vision tower and projector: its keys and its tensors, as tables that
the converter, the tensor diff, the graph's loader and the tests all read.

llama.cpp keeps a model's vision encoder in a separate GGUF (`general.architecture = clip`,
`clip.*` / `clip.vision.*` keys, `v.*` and `mm.*` tensors) that its multimodal tool loads beside
the text model. Upstream has projectors for the two earlier MoonViT models, Kimi-VL (`kimivl`) and
Kimi-K2.5 (`kimik25`); K3's tower is K2.5's MoonViT3d with other choices, so this file follows
`kimik25`'s names where the math is the same and says where it is not:

* `clip.projector_type` is `kimik3`, a type upstream does not have: upstream's `kimik25` graph
  would need `mm.input_norm` (a LayerNorm before the projector, with bias) and biases on `mm.1`
  and `mm.2`, none of which K3 has, and it would apply LayerNorm with bias in the blocks,
  bicubic position-embedding resizing and a tanh GELU in the projector, where K3 has RMSNorm
  without bias, bilinear resizing and an erf GELU.
* `mm.post_norm` is K3's projector post-norm (RMSNorm, its own eps:
  `clip.vision.kimik3.projector.layer_norm_epsilon`); `clip.vision.attention.layer_norm_epsilon`
  is the blocks' RMSNorm eps (float32 machine eps, which the reference falls back to; upstream's
  `kimik25` writes the projector's there).
* `v.blk.N.attn_qkv` keeps the checkpoint's row order (q heads, k heads, v heads, each head's
  RoPE pairs interleaved). Upstream's `kimik25` permutes the q and k rows into ggml's split RoPE
  layout; this project's graph rotates the interleaved pairs itself (from a host-side angle
  table), so the tensor stays byte for byte the checkpoint's.
* The processor's settings that upstream does not store are `clip.vision.kimik3.*` keys: the
  per-side patch limit, the transparent background, the placeholder token id.

No tensor is transformed: every one is the checkpoint's bytes (1-D norm gains widened to F32,
which keeps every value, as the text model's norms are).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Mapping

import numpy as np
from gguf import GGUFValueType as T
from gguf import Keys

from ..errors import GGUFError
from ..io.gguf_values import problem as value_problem
from . import tensors as TT
from .tensors import FLOAT, OUT_F32, OUT_SOURCE, PlannedTensor, Source, TensorSpec
from .vision import VIT_NORM_EPS, BackgroundConfig, MediaConfig, VisionConfig, vision_problems

ARCH = "clip"
PROJECTOR_TYPE = "kimik3"
GGUF_TYPE = "mmproj"  # general.type, as llama.cpp's converter writes for an mmproj
K3 = "clip.vision.kimik3."

# ---- tensors ------------------------------------------------------------------------------------
# Names as llama.cpp's mtmd reads them (clip-impl.h): "v." before the encoder's, the blocks under
# v.blk.N. like the text model's layers; ffn_up/ffn_down are the text table's names.
V = "v."
V_LAYER = V + TT.LAYER
V_PATCH_EMBD = V + "patch_embd.weight"
V_POS_EMBD = V + "position_embd.weight"
V_ATTN_QKV = V_LAYER + "attn_qkv.weight"
V_ATTN_OUT = V_LAYER + "attn_out.weight"
V_LN1 = V_LAYER + "ln1.weight"
V_LN2 = V_LAYER + "ln2.weight"
V_FFN_UP = V + TT.FFN_UP
V_FFN_DOWN = V + TT.FFN_DOWN
V_POST_LN = V + "post_ln.weight"
MM_1 = "mm.1.weight"
MM_2 = "mm.2.weight"
MM_POST_NORM = "mm.post_norm.weight"

# The checkpoint's namespaces of the tower and the projector (no language_model. prefix).
VISION_PREFIXES = TT.SKIP_PREFIXES
_BLOCK = "vision_tower.encoder.blocks.{l}."

VShape = Callable[[VisionConfig], tuple]


def _row(group: str, gguf: str, hf: str, shape: VShape, out: str = OUT_SOURCE) -> TensorSpec:
    return TensorSpec(group, gguf, (Source(hf, shape, FLOAT),), shape, out)


_C = lambda v: (v.hidden_size,)  # noqa: E731 - shape helpers read like the spec's symbols

# Groups, in file order: "tower" before the blocks, "block" per block, "head" after them.
VISION_TABLE: tuple[TensorSpec, ...] = (
    _row("tower", V_PATCH_EMBD, "vision_tower.patch_embed.proj.weight",
         lambda v: (v.hidden_size, 3, v.patch_size, v.patch_size)),
    _row("tower", V_POS_EMBD, "vision_tower.patch_embed.pos_emb.weight",
         lambda v: (v.pos_emb_height, v.pos_emb_width, v.hidden_size)),
    _row("block", V_ATTN_QKV, _BLOCK + "wqkv.weight", lambda v: (3 * v.qkv_size, v.hidden_size)),
    _row("block", V_ATTN_OUT, _BLOCK + "wo.weight", lambda v: (v.hidden_size, v.qkv_size)),
    _row("block", V_LN1, _BLOCK + "norm0.weight", _C, OUT_F32),
    _row("block", V_LN2, _BLOCK + "norm1.weight", _C, OUT_F32),
    _row("block", V_FFN_UP, _BLOCK + "mlp.fc0.weight", lambda v: (v.intermediate_size, v.hidden_size)),
    _row("block", V_FFN_DOWN, _BLOCK + "mlp.fc1.weight", lambda v: (v.hidden_size, v.intermediate_size)),
    _row("head", V_POST_LN, "vision_tower.encoder.final_layernorm.weight", _C, OUT_F32),
    _row("head", MM_1, "mm_projector.proj.0.weight", lambda v: (v.merged_size, v.merged_size)),
    _row("head", MM_2, "mm_projector.proj.2.weight", lambda v: (v.text_hidden_size, v.merged_size)),
    _row("head", MM_POST_NORM, "mm_projector.post_norm.weight", lambda v: (v.text_hidden_size,), OUT_F32),
)


def _expand(spec: TensorSpec, vcfg: VisionConfig, block: int | None) -> PlannedTensor:
    fmt = {} if block is None else {"l": block}
    src = spec.sources[0]
    return PlannedTensor(spec, block, spec.gguf.format(**fmt), tuple(spec.shape(vcfg)),
                         ((src.name.format(**fmt), tuple(src.shape(vcfg))),))


def plan_vision_tensors(vcfg: VisionConfig) -> Iterator[PlannedTensor]:
    """Every tensor of the mmproj in file order: the embeddings, block by block, then the head."""
    yield from (_expand(s, vcfg, None) for s in VISION_TABLE if s.group == "tower")
    for block in range(vcfg.num_layers):
        yield from (_expand(s, vcfg, block) for s in VISION_TABLE if s.group == "block")
    yield from (_expand(s, vcfg, None) for s in VISION_TABLE if s.group == "head")


def vision_block(name: str) -> int | None:
    """The block of a `v.blk.N.*` name, None for the others."""
    return TT.gguf_layer(name[len(V):]) if name.startswith(V) else None


def is_vision_source(hf_name: str) -> bool:
    """A checkpoint tensor of the tower or the projector."""
    return hf_name.startswith(VISION_PREFIXES)


# ---- keys ---------------------------------------------------------------------------------------

Read = Callable[[Any, Mapping[str, Any]], Mapping[str, Any]]


@dataclass(frozen=True)
class VKey:
    """One key of the mmproj: the VisionConfig field it holds (dotted: "media.in_patch_limit"),
    or the value it derives; `read` gives a derived key's fields back."""

    name: str
    vtype: T
    field: str | None = None
    derive: Callable[[VisionConfig], Any] | None = None
    sub_type: T | None = None
    read: Read | None = None
    holds: tuple[str, ...] = ()

    @property
    def fields_held(self) -> tuple[str, ...]:
        return self.holds if self.read is not None else (self.field,) if self.field else ()

    def value(self, vcfg: VisionConfig) -> Any:
        if self.derive is not None:
            return self.derive(vcfg)
        value: Any = vcfg
        for part in self.field.split("."):
            value = getattr(value, part)
        return list(value) if isinstance(value, tuple) else value

    def fields_from(self, value: Any, so_far: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.read(value, so_far) if self.read is not None else {self.field: value}


def _per_side(value: int, got: Mapping[str, Any]) -> Mapping[str, Any]:
    patch = got["patch_size"]
    if value % (patch * patch):
        raise ValueError(f"must be a whole number of {patch}x{patch} patches, got {value}")
    return {"media.in_patch_limit": value // (patch * patch)}


_BG = K3 + "background."
MMPROJ_KEYS: tuple[VKey, ...] = (
    VKey(Keys.General.TYPE, T.STRING, derive=lambda v: GGUF_TYPE),
    VKey(Keys.Clip.PROJECTOR_TYPE, T.STRING, derive=lambda v: PROJECTOR_TYPE),
    VKey(Keys.Clip.HAS_VISION_ENCODER, T.BOOL, derive=lambda v: True),
    VKey(Keys.ClipVision.PATCH_SIZE, T.UINT32, "patch_size"),
    VKey(Keys.ClipVision.EMBEDDING_LENGTH, T.UINT32, "hidden_size"),
    VKey(Keys.ClipVision.FEED_FORWARD_LENGTH, T.UINT32, "intermediate_size"),
    VKey(Keys.ClipVision.BLOCK_COUNT, T.UINT32, "num_layers"),
    VKey(Keys.ClipVision.Attention.HEAD_COUNT, T.UINT32, "num_heads"),
    # llama.cpp's clip reads it as KEY_N_EMBD_HEAD (gguf-py has no constant for it).
    VKey("clip.vision.attention.head_dim", T.UINT32, derive=lambda v: v.head_dim,
         read=lambda x, got: {"qkv_size": x * got["num_heads"]}, holds=("qkv_size",)),
    VKey(Keys.ClipVision.Attention.LAYERNORM_EPS, T.FLOAT32, derive=lambda v: VIT_NORM_EPS),
    VKey(Keys.ClipVision.PROJECTION_DIM, T.UINT32, "text_hidden_size"),
    VKey(Keys.ClipVision.Projector.SCALE_FACTOR, T.UINT32, "merge_kernel"),
    # upstream kimik25's image_size: the position table's height in pixels (informational).
    VKey(Keys.ClipVision.IMAGE_SIZE, T.UINT32, derive=lambda v: v.pos_emb_height * v.patch_size),
    VKey(Keys.ClipVision.IMAGE_MEAN, T.ARRAY, "media.image_mean", sub_type=T.FLOAT32),
    VKey(Keys.ClipVision.IMAGE_STD, T.ARRAY, "media.image_std", sub_type=T.FLOAT32),
    VKey(Keys.ClipVision.IMAGE_MAX_PIXELS, T.UINT32, derive=lambda v: v.media.in_patch_limit * v.patch_size ** 2,
         read=_per_side, holds=("media.in_patch_limit",)),
    # upstream kimik25's own spelling of these three (no clip. prefix).
    VKey("vision.pos_emb_height", T.UINT32, "pos_emb_height"),
    VKey("vision.pos_emb_width", T.UINT32, "pos_emb_width"),
    VKey("vision.pos_emb_time", T.UINT32, "pos_emb_time"),
    VKey(K3 + "projector.layer_norm_epsilon", T.FLOAT32, "projector_eps"),
    VKey(K3 + "pos_emb_interpolation", T.STRING, derive=lambda v: "bilinear"),
    VKey(K3 + "patch_limit_on_one_side", T.UINT32, "media.patch_limit_on_one_side"),
    VKey(K3 + "media_placeholder_token_id", T.UINT32, "media_placeholder_id"),
    VKey(_BG + "pattern", T.STRING, "media.background.pattern"),
    VKey(_BG + "square_size", T.UINT32, "media.background.square_size"),
    VKey(_BG + "square_on_top_left", T.BOOL, "media.background.square_on_top_left"),
    VKey(_BG + "white_value", T.UINT32, "media.background.white_value"),
    VKey(_BG + "gray_value", T.UINT32, "media.background.gray_value"),
    VKey(_BG + "fill_stage", T.STRING, "media.background.fill_stage"),
)


def mmproj_keys(vcfg: VisionConfig) -> list[tuple[str, Any, T, T | None]]:
    """(key, value, type, array element type) of every key of the table, in file order."""
    return [(k.name, k.value(vcfg), k.vtype, k.sub_type) for k in MMPROJ_KEYS]


def _is_type(vtype: T, value: Any) -> bool:
    if vtype == T.FLOAT32:
        return isinstance(value, float)
    if vtype == T.BOOL:
        return isinstance(value, bool)
    if vtype == T.STRING:
        return isinstance(value, str)
    if vtype == T.ARRAY:
        return isinstance(value, list)
    return isinstance(value, int) and not isinstance(value, bool)


def _read_fields(meta: Mapping[str, Any], where: str) -> dict[str, Any]:
    got: dict[str, Any] = {}
    for k in MMPROJ_KEYS:
        if not k.fields_held:
            continue
        if k.name not in meta:
            raise GGUFError(f"{where}: missing metadata key {k.name!r}")
        value = meta[k.name]
        if not _is_type(k.vtype, value):
            raise GGUFError(f"{where}: metadata {k.name} is {value!r}, expected a {k.vtype.name} value")
        try:
            got.update(k.fields_from(value, got))
        except ValueError as exc:
            raise GGUFError(f"{where}: {k.name} {exc}") from None
    return got


def _build(got: Mapping[str, Any]) -> VisionConfig:
    """VisionConfig from dotted field names ("media.background.pattern" goes to cfg.media.background)."""
    def part(cls, prefix: str, nested: Mapping[str, Any]):
        values = {f.name: nested.get(f.name, got.get(prefix + f.name)) for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
    background = part(BackgroundConfig, "media.background.", {})
    return part(VisionConfig, "", {"media": part(MediaConfig, "media.", {"background": background})})


def _same(want: Any, got: Any, vtype: T, sub: T | None) -> bool:
    if vtype == T.ARRAY:
        return isinstance(got, list) and len(got) == len(want) and all(
            _same(w, g, sub, None) for w, g in zip(want, got))
    if vtype == T.FLOAT32:
        return isinstance(got, float) and np.float32(want) == np.float32(got)
    return type(got) is type(want) and got == want


def vision_config_from_metadata(meta: Mapping[str, Any], where: str) -> VisionConfig:
    """The tower's config from an mmproj's keys, every key of the table checked against the file.

    A GGUF that is not a Kimi K3 mmproj (a text model, another model's mmproj) is refused by its
    architecture and projector type before anything else is read."""
    arch, proj = meta.get("general.architecture"), meta.get(Keys.Clip.PROJECTOR_TYPE)
    if arch != ARCH or proj != PROJECTOR_TYPE:
        raise GGUFError(f"{where}: not a Kimi K3 mmproj (general.architecture {arch!r}, {Keys.Clip.PROJECTOR_TYPE} "
                        f"{proj!r}; expected {ARCH!r} and {PROJECTOR_TYPE!r}, as convert-kimi-k3 --mmproj writes)")
    vcfg = _build(_read_fields(meta, where))
    problems = vision_problems(vcfg)
    if problems:
        raise GGUFError(f"{where}: {'; '.join(problems)}")
    for name, want, vtype, sub in mmproj_keys(vcfg):
        got = meta.get(name)
        why = value_problem(vtype, got, sub) if name in meta else "is missing"
        if why is not None:
            raise GGUFError(f"{where}: metadata {name} {why}")
        if not _same(want, got, vtype, sub):
            raise GGUFError(f"{where}: metadata {name} is {got!r}, expected {want!r} "
                            "(inconsistent with the other kimik3 keys)")
    return vcfg
