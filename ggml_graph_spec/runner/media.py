"""Images and clips in kimi-k3-cli, with llama-mtmd-cli's options: --mmproj, --image, --video.

Everything is checked before any ggml object exists (`check_media`): the mmproj's keys and
tensors, that it is the text model's (the width of its rows, its placeholder token: read from the
text GGUF's header), every file of every item (Pillow; vision/preprocess.py), and that the
prompt's `<__media__>` markers match the items. The encoder is opened after the model, on the
same path: F32 everywhere with --exact-experts, the weights as stored otherwise.

In a conversation, `/image FILE` and `/video F0,F1,...` add an item to the next turn (llama-mtmd-cli's
`/image`); a bad file there is an error line and the conversation goes on.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from gguf_arch.arch.keys import config_from_metadata, upgrade_legacy_keys
from gguf_arch.io.console import UsageError
from gguf_arch.io.gguf_file import open_gguf

from ..text.tokenizer import BPETokenizer
from ..vision.encode import VisionEncoder
from ..vision.preprocess import MediaItem, load_media
from ..vision.prompt import MEDIA_PAD, expand_markers
from ..vision.weights import MmprojFile, check_pairing, open_mmproj
from ..weights.loader import read_metadata

IMAGE_COMMAND, VIDEO_COMMAND = "/image", "/video"


def frames(text: str) -> list[Path]:
    """--video's value: a clip's frame files, comma-separated."""
    paths = text.split(",")
    if not all(p.strip() for p in paths):
        raise argparse.ArgumentTypeError(f"{text!r}: expected frame files separated by commas, e.g. f0.png,f1.png")
    return [Path(p.strip()) for p in paths]


def images(text: str) -> list[list[Path]]:
    """--image's value: one image, or several separated by commas; each one media item."""
    paths = text.split(",")
    if not all(p.strip() for p in paths):
        raise argparse.ArgumentTypeError(f"{text!r}: expected image files separated by commas, e.g. a.png,b.png")
    return [[Path(p.strip())] for p in paths]


def add_mmproj_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("-mm", "--mmproj", type=Path, metavar="MMPROJ.gguf",
                   help="the model's vision tower and projector (convert-kimi-k3 --mmproj)")


def add_media_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("images and clips (llama-mtmd-cli's options)")
    add_mmproj_argument(g)
    g.add_argument("--image", dest="media", action="extend", default=[], type=images, metavar="FILE[,FILE...]",
                   help="an image (PNG, JPEG, WebP) for the prompt's next <__media__> marker; several separated by "
                        "commas, as llama.cpp takes them (repeatable; the items in command-line order; no marker: in "
                        "front of the prompt)")
    g.add_argument("--video", dest="media", action="append", type=frames, metavar="F0,F1,...",
                   help="the frames of one clip, all one size (repeatable, in order with --image)")


def text_model_facts(path: Path) -> tuple[int, int | None]:
    """The text GGUF's embedding width and <|media_pad|> id, from its header (no ggml)."""
    reader = open_gguf(path)
    meta, _notes = upgrade_legacy_keys(read_metadata([reader]), str(path))
    return config_from_metadata(meta, str(path)).hidden_size, BPETokenizer.from_gguf(reader).special_id(MEDIA_PAD)


def check_mmproj(mmproj: Path, model: Path) -> MmprojFile:
    """The mmproj checked, and checked to be the text model's, without ggml (GGUFError)."""
    checked = open_mmproj(mmproj)
    check_pairing(checked.cfg, str(mmproj), *text_model_facts(model))
    return checked


@dataclass
class MediaInput:
    """A checked mmproj and the command line's media items, in order; the encoder once opened."""

    mmproj: MmprojFile
    items: list[MediaItem]
    encoder: VisionEncoder | None = None

    def open(self, exact: bool, threads: int | None) -> VisionEncoder:
        self.encoder = VisionEncoder.open(self.mmproj, exact=exact, threads=threads)
        return self.encoder

    def summary(self) -> list[str]:
        """The print_info line of the mmproj, beside the model's."""
        c, path = self.mmproj.cfg, "exact (F32)" if self.encoder is not None and self.encoder.weights.exact else "fast"
        return [f"print_info: {'mmproj':<16} = {self.mmproj.path} ({c.num_layers} vision blocks, {path}; "
                f"{len(self.items)} media item(s) on the command line)"]

    def close(self) -> None:
        if self.encoder is not None:
            self.encoder.close()
            self.encoder = None


def check_media(a: argparse.Namespace, text: str | None) -> MediaInput | None:
    """The media options, checked (module docstring); None without --mmproj."""
    if a.mmproj is None:
        if a.media:
            raise UsageError("--image and --video need --mmproj MMPROJ.gguf (the model's vision tower)")
        return None
    if a.mode == "perplexity":
        raise UsageError("--mmproj, --image and --video apply to prompts, not to --perplexity")
    mmproj = check_mmproj(a.mmproj, a.model)
    items = [load_media(paths, mmproj.cfg) for paths in a.media]
    if text is not None:  # the markers' count against the items' (a conversation: its first turn's)
        expand_markers(text, items)
    return MediaInput(mmproj, items)


def media_command(line: str) -> tuple[str, str] | None:
    """(command, argument) of a conversation's /image or /video line; None for any other input."""
    command, _, arg = line.strip().partition(" ")
    return (command, arg.strip()) if command in (IMAGE_COMMAND, VIDEO_COMMAND) else None


def command_item(encoder: VisionEncoder | None, command: str, arg: str) -> MediaItem:
    """The item a /image or /video line names, read and checked (UsageError, MediaError)."""
    if encoder is None:
        raise UsageError(f"{command} needs --mmproj MMPROJ.gguf (the model's vision tower)")
    if not arg:
        raise UsageError(f"{command} needs a file: {command} {'FILE' if command == IMAGE_COMMAND else 'F0,F1,...'}")
    try:
        paths = [Path(arg)] if command == IMAGE_COMMAND else frames(arg)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"{command} {exc}") from None
    return load_media(paths, encoder.cfg)
