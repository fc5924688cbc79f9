"""Strict reader for Kimi K3's vision tower and projector: `vision_config` of config.json and the
image processor's `media_proc_cfg` (preprocessor_config.json).

The tower is MoonViT (patch embedding, `divided_fixed` position embeddings, RMSNorm encoder blocks
with a 2D RoPE, `sd2_tpool` merge) and the projector `patchmergerv2`. Every field the graph reads
is required and range-checked, and every field whose other values would describe another model
(`merge_type`, `norm_type`, the biases, ...) must have K3's value: all problems are reported
together, one line. What the reference code hard-codes instead of reading (the ViT's RMSNorm eps,
the RoPE base and grid, the time embedding's base) are the constants below. The facts:
docs/reference/vision.md.

The released checkpoint ships the processor's settings in `preprocessor_config.json`; a
checkpoint without it (the tiny fixtures) gets K3's published values, with the tower's own patch
and merge sizes (`PUBLISHED_MEDIA`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..io.jsonfile import read_json
from .config import read_config_json, text_section
from .config_fields import ANY, BOOL, FLOAT, INT, LIST, POSITIVE, STR, Field, kind_text, type_ok

# nn.RMSNorm(C) built without eps falls back to torch.finfo(dtype).eps: the float32 reference's.
VIT_NORM_EPS = float(np.finfo(np.float32).eps)
ROPE_THETA = 10000.0  # base of the 2D RoPE's frequencies
ROPE_GRID = 512  # the RoPE table covers 512 x 512 patches: no image may be wider or taller
TIME_BASE = 10000.0  # base of the 1D sincos time embedding (t > 1)
CHANNELS = 3

VISION = "vision_config."
MEDIA = "preprocessor_config.json media_proc_cfg."
PREPROCESSOR_FILE = "preprocessor_config.json"

VISION_FIELDS: tuple[Field, ...] = (
    Field("patch_size", INT, "patch_size", POSITIVE, section=VISION),
    Field("vt_hidden_size", INT, "hidden_size", POSITIVE, section=VISION),
    Field("qkv_hidden_size", INT, "qkv_size", POSITIVE, section=VISION),
    Field("vt_num_attention_heads", INT, "num_heads", POSITIVE, section=VISION),
    Field("vt_intermediate_size", INT, "intermediate_size", POSITIVE, section=VISION),
    Field("vt_num_hidden_layers", INT, "num_layers", POSITIVE, section=VISION),
    Field("init_pos_emb_height", INT, "pos_emb_height", POSITIVE, section=VISION),
    Field("init_pos_emb_width", INT, "pos_emb_width", POSITIVE, section=VISION),
    Field("init_pos_emb_time", INT, "pos_emb_time", POSITIVE, section=VISION),
    Field("merge_kernel_size", LIST, "merge_kernel", section=VISION),  # [k, k], read by _merge_kernel
    Field("mm_hidden_size", INT, section=VISION),  # the projector's input width: vt_hidden_size
    Field("text_hidden_size", INT, "text_hidden_size", POSITIVE, section=VISION),
    Field("projector_ln_eps", FLOAT, "projector_eps", POSITIVE, section=VISION),
    Field("merge_type", STR, fixed="sd2_tpool", section=VISION),
    Field("pos_emb_type", STR, fixed="divided_fixed", section=VISION),
    Field("pos_emb_interpolation_mode", STR, fixed="bilinear", section=VISION),
    Field("norm_type", STR, fixed="rmsnorm", section=VISION),
    Field("mlp_type", STR, fixed="mlp2", section=VISION),
    Field("mm_projector_type", STR, fixed="patchmergerv2", section=VISION),
    Field("attn_bias", BOOL, fixed=False, section=VISION),
    Field("linear_bias", BOOL, fixed=False, section=VISION),
    Field("patch_embed_proj_bias", BOOL, fixed=False, section=VISION),
    Field("media_placeholder_token_id", INT, "media_placeholder_id", section=""),
)
# Not read, as the reference reads neither: `activation_func` and `projector_hidden_act` (the
# ViT's GELU is the tanh form and the projector's the erf form, both hard-coded) and
# `_attn_implementation` (only picks a kernel for the same math).

BACKGROUNDS = ("none", "white", "black", "gray", "chessboard")  # "none": alpha dropped, no compositing
FILL_STAGES = ("before_resize", "after_resize")


@dataclass(frozen=True)
class BackgroundConfig:
    """What a transparent image is composited onto, and when (the processor's transparent_bg_config)."""

    pattern: str  # one of BACKGROUNDS
    square_size: int
    square_on_top_left: bool  # True: the top-left square is white
    white_value: int
    gray_value: int
    fill_stage: str  # one of FILL_STAGES


@dataclass(frozen=True)
class MediaConfig:
    """The image processor's settings: normalisation and the pixel limits of the resize."""

    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    in_patch_limit: int  # patches an image may have before it is scaled down
    patch_limit_on_one_side: int  # patches along one side at most
    background: BackgroundConfig


@dataclass(frozen=True)
class VisionConfig:
    patch_size: int
    hidden_size: int  # C, the tower's width
    qkv_size: int  # Q: q, k and v are each Q wide (may differ from C)
    num_heads: int
    intermediate_size: int
    num_layers: int
    pos_emb_height: int  # the learnt position table is [height, width, C]
    pos_emb_width: int
    pos_emb_time: int  # frames a media item may have (length of the sincos time table)
    merge_kernel: int  # k: k x k patches merge into one token
    text_hidden_size: int  # the projector's output width
    projector_eps: float  # the projector's post-norm eps
    media_placeholder_id: int  # <|media_pad|>
    media: MediaConfig

    @property
    def head_dim(self) -> int:
        return self.qkv_size // self.num_heads

    @property
    def merged_size(self) -> int:
        """The projector's input width: k * k patch vectors side by side."""
        return self.hidden_size * self.merge_kernel ** 2

    @property
    def unit(self) -> int:
        """Pixels per merged token along a side: images are padded to a multiple of it."""
        return self.patch_size * self.merge_kernel


# K3's published processor settings (media_proc_cfg) but patch_size and merge_kernel_size, which
# are the tower's own (14 and 2 in the released file).
PUBLISHED_MEDIA: dict[str, Any] = {
    "in_patch_limit": 65536, "patch_limit_on_one_side": 512, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "fixed_output_tokens": None, "transparent_bg_fill_stage": "after_resize",
    "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                              "chessboard_square_on_top_left": True, "chessboard_white_value": 255,
                              "chessboard_gray_value": 180},
}


def _field_values(section: dict, fields: tuple[Field, ...], top: dict, errors: list[str]) -> dict[str, Any]:
    """attr -> value of every row with an attr; type and fixed-value problems into errors."""
    missing, got = [], {}
    for f in fields:
        where = top if f.section == "" else section
        if f.hf not in where:
            missing.append(f.where)
            continue
        value = where[f.hf]
        if not type_ok(f.kind, value):
            errors.append(f"{f.where} must be {kind_text(f.kind)}, got {value!r}")
        elif f.fixed is not ANY and value != f.fixed:
            errors.append(f"{f.where} must be {f.fixed!r} for Kimi K3's vision tower, got {value!r}")
        else:
            got[f.hf] = value
            if f.attr is not None:
                got[f.attr] = float(value) if f.kind == FLOAT else value
    if missing:
        errors.insert(0, f"missing required field(s): {', '.join(missing)}")
    return got


def _merge_kernel(value: Any, errors: list[str]) -> int:
    if (not isinstance(value, list) or len(value) != 2 or not all(type_ok(INT, v) for v in value)
            or value[0] != value[1]):
        errors.append(f"{VISION}merge_kernel_size must be [k, k] (a square merge), got {value!r}")
        return 0
    return value[0]


def _cross_field_problems(got: dict[str, Any], text: dict) -> list[str]:
    """The config.json checks that read two fields (the rest: vision_problems, on the result)."""
    errors = []
    if "mm_hidden_size" in got and "hidden_size" in got and got["mm_hidden_size"] != got["hidden_size"]:
        errors.append(f"{VISION}mm_hidden_size ({got['mm_hidden_size']}) must equal vt_hidden_size "
                      f"({got['hidden_size']}): the projector reads the tower's merged output")
    width = text.get("hidden_size")
    if "text_hidden_size" in got and type_ok(INT, width) and width != got["text_hidden_size"]:
        errors.append(f"{VISION}text_hidden_size ({got['text_hidden_size']}) must equal text_config.hidden_size "
                      f"({width}): the projector's rows replace token embeddings")
    return errors


_POSITIVE = tuple(f for f in VISION_FIELDS if f.rule == POSITIVE)


def _media_problems(m: MediaConfig) -> list[str]:
    bg = m.background
    problems = [] if len(m.image_mean) == CHANNELS and len(m.image_std) == CHANNELS and min(m.image_std) > 0 \
        else [f"image_mean and image_std must be {CHANNELS} numbers each, the std > 0, got {m.image_mean}, {m.image_std}"]
    problems += [] if m.in_patch_limit >= 1 else [f"in_patch_limit must be >= 1, got {m.in_patch_limit}"]
    if not 1 <= m.patch_limit_on_one_side <= ROPE_GRID:
        problems.append(f"patch_limit_on_one_side must be in 1..{ROPE_GRID} (the RoPE table's side), "
                        f"got {m.patch_limit_on_one_side}")
    if bg.pattern not in BACKGROUNDS or bg.fill_stage not in FILL_STAGES or bg.square_size < 1 \
            or not (0 <= bg.white_value <= 255 and 0 <= bg.gray_value <= 255):
        problems.append(f"transparent background: pattern one of {list(BACKGROUNDS)}, fill stage one of "
                        f"{list(FILL_STAGES)}, square size >= 1, values 0..255 expected, got {bg}")
    return problems


def vision_problems(v: VisionConfig) -> list[str]:
    """What makes a VisionConfig unusable by the graph (from config.json or read back from an
    mmproj): every size >= 1, eps > 0, the heads' widths, the processor's limits."""
    problems = [f"{f.hf} ({f.attr}) must be > 0, got {getattr(v, f.attr)!r}" for f in _POSITIVE
                if not getattr(v, f.attr) > 0 or not np.isfinite(getattr(v, f.attr))]
    if v.merge_kernel < 1:
        problems.append(f"merge_kernel_size must be >= 1, got {v.merge_kernel}")
    if v.num_heads > 0 and (v.qkv_size % v.num_heads or (v.qkv_size // v.num_heads) % 4):
        problems.append(f"qkv_hidden_size ({v.qkv_size}) must be vt_num_attention_heads ({v.num_heads}) heads of "
                        "a multiple of 4 (the 2D RoPE rotates pairs alternately by column and row)")
    return problems + _media_problems(v.media)


def _number_list(cfg: dict, key: str, errors: list[str]) -> tuple[float, ...]:
    v = cfg.get(key)
    if not (isinstance(v, list) and len(v) == CHANNELS and all(type_ok(FLOAT, x) for x in v)):
        errors.append(f"{MEDIA}{key} must be {CHANNELS} finite numbers, got {v!r}")
        return ()
    return tuple(float(x) for x in v)


def _count(cfg: dict, key: str, errors: list[str]) -> int:
    v = cfg.get(key)
    if not type_ok(INT, v):
        errors.append(f"{MEDIA}{key} must be {kind_text(INT)}, got {v!r}")
        return 0
    return v


def _background(cfg: dict, errors: list[str]) -> BackgroundConfig:
    """transparent_bg_config as the processor reads it (absent: alpha dropped), with its defaults."""
    bg, stage = cfg.get("transparent_bg_config"), cfg.get("transparent_bg_fill_stage", "before_resize")
    if bg is None:
        return BackgroundConfig("none", 16, True, 255, 200, stage)
    if not isinstance(bg, dict):
        errors.append(f"{MEDIA}transparent_bg_config must be an object, got {bg!r}")
        return BackgroundConfig("none", 16, True, 255, 200, stage)
    values = [bg.get(k, d) for k, d in (("chessboard_square_size", 16), ("chessboard_white_value", 255),
                                         ("chessboard_gray_value", 200))]
    top_left = bg.get("chessboard_square_on_top_left", True)
    if not all(type_ok(INT, v) for v in values) or not isinstance(top_left, bool):
        errors.append(f"{MEDIA}transparent_bg_config: integer chessboard sizes and values and a boolean "
                      f"chessboard_square_on_top_left expected, got {bg!r}")
        return BackgroundConfig("none", 16, True, 255, 200, stage)
    return BackgroundConfig(bg.get("pattern", "black"), values[0], top_left, values[1], values[2], stage)


def _sizes_agree(cfg: dict, got: dict[str, Any], errors: list[str]) -> None:
    for key, attr in (("patch_size", "patch_size"), ("merge_kernel_size", "merge_kernel")):
        value = cfg.get(key)
        if isinstance(value, list) and len(value) == 2 and value[0] == value[1]:
            value = value[0]  # [k, k] or k: the processor's file has been seen with either
        if key in cfg and attr in got and value != got[attr]:
            errors.append(f"{MEDIA}{key} is {cfg[key]!r}, the tower's ({VISION}) is {got[attr]!r}")


def parse_media(cfg: Any, got: dict[str, Any], errors: list[str]) -> MediaConfig | None:
    """The processor's settings from a media_proc_cfg object; problems into errors."""
    if not isinstance(cfg, dict):
        errors.append(f"{MEDIA.rstrip('.')} must be an object, got {cfg!r}")
        return None
    _sizes_agree(cfg, got, errors)
    if cfg.get("fixed_output_tokens") is not None:
        errors.append(f"{MEDIA}fixed_output_tokens must be null (a token count from the image's own size), "
                      f"got {cfg['fixed_output_tokens']!r}")
    return MediaConfig(_number_list(cfg, "image_mean", errors), _number_list(cfg, "image_std", errors),
                       _count(cfg, "in_patch_limit", errors),
                       _count(cfg, "patch_limit_on_one_side", errors), _background(cfg, errors))


def parse_vision_config(raw: Any, media_cfg: Any, source: str = "config.json") -> VisionConfig:
    """The vision tower's architecture from a parsed config.json and media_proc_cfg; ConfigError
    lists every problem."""
    if not isinstance(raw, dict) or not isinstance(raw.get("vision_config"), dict):
        raise ConfigError(f"{source}: vision_config is missing or not an object (no vision tower to convert)")
    errors: list[str] = []
    text = text_section(raw)
    got = _field_values(raw["vision_config"], VISION_FIELDS, raw, errors)
    if "merge_kernel" in got:
        got["merge_kernel"] = _merge_kernel(got["merge_kernel"], errors)
    errors += _cross_field_problems(got, text if isinstance(text, dict) else {})
    media = parse_media(media_cfg, got, errors)
    if errors:
        raise ConfigError(f"{source}: {'; '.join(errors)}")
    vcfg = VisionConfig(**{f.attr: got[f.attr] for f in VISION_FIELDS if f.attr is not None}, media=media)
    problems = vision_problems(vcfg)
    if problems:
        raise ConfigError(f"{source}: {'; '.join(problems)}")
    return vcfg


def read_media_config(model_dir: Path | str) -> tuple[Any, str]:
    """(media_proc_cfg, where it came from): the checkpoint's preprocessor_config.json, or K3's
    published values when the checkpoint has none."""
    path = Path(model_dir) / PREPROCESSOR_FILE
    if not path.exists():
        return None, f"no {PREPROCESSOR_FILE}: K3's published image processor settings"
    raw = read_json(path, ConfigError, "not found")
    cfg = raw.get("media_proc_cfg", raw) if isinstance(raw, dict) else raw
    return cfg, f"image processor settings from {path}"


def load_vision_config(model_dir: Path | str) -> tuple[VisionConfig, str]:
    """Read and validate the vision tower's config; also says where the processor settings came from."""
    path, raw = read_config_json(model_dir)
    media, origin = read_media_config(model_dir)
    return parse_vision_config(raw, PUBLISHED_MEDIA if media is None else media, str(path)), origin
