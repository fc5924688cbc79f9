"""Generated checkpoints for tests that need other sizes than the fixtures' (kimi-k3-synth)."""
from __future__ import annotations

from pathlib import Path

import convert_kimi_k3
from gguf_arch.synth import cli as synth

# Expert rows of 256 (latent 256, expert width 256): the 256-wide K-quant and i-quant blocks fit,
# which the fixtures' 64/32-wide experts do not. 4 layers: dense KDA, KDA+MoE x2, MLA(+DSA)+MoE.
ROWS_256 = ("--layers", "4", "--experts", "4", "--latent", "256", "--moe-intermediate", "256")


def generated_gguf(out_dir: Path, variant: str, *synth_args: str) -> Path:
    """kimi-k3-synth OUT_DIR/model --variant VARIANT SYNTH_ARGS, converted as released."""
    model, gguf = out_dir / "model", out_dir / "model.gguf"
    assert synth.main([str(model), "--variant", variant, *synth_args]) == 0
    assert convert_kimi_k3.main([str(model), str(gguf), "--quiet"]) == 0
    return gguf
