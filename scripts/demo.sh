#!/usr/bin/env bash
# The README's main job: generate a tiny Kimi-K3.1-Pro checkpoint in the released on-disk format,
# convert it to GGUF, inspect the result and run it on the ggml graph. Idempotent: every step
# replaces its previous output.
#   bash scripts/demo.sh [OUT_DIR]     (default: out/ in the repository root)
set -euo pipefail
# Only what converting and running need: the tests' extras and llama.cpp's tools come with test.sh.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh" demo
cd "$ROOT"

OUT="${1:-out}"
MODEL="$OUT/tiny-model"
GGUF="$OUT/tiny.gguf"

echo "== generate $MODEL (seeded random weights, tiny preset)"
python -m gguf_arch.synth.cli "$MODEL" --preset tiny --variant k31pro --overwrite

echo "== convert to $GGUF"
python convert_kimi_k3.py "$MODEL" "$GGUF" --overwrite

echo "== inspect $GGUF"
python - "$GGUF" <<'EOF'
import sys
from collections import Counter

from gguf import GGUFReader

from gguf_arch.arch.keys import ARCH, INDEXER_TYPES

reader = GGUFReader(sys.argv[1])
arch = reader.fields["general.architecture"].contents()
types = Counter(t.tensor_type.name for t in reader.tensors)
print(f"architecture: {arch}")
print(f"tensors: {len(reader.tensors)} ({', '.join(f'{n} {t}' for t, n in sorted(types.items()))})")
for name, field in reader.fields.items():
    if name == INDEXER_TYPES:  # a bool per layer: shown as the layers it marks
        marked = [layer for layer, dsa in enumerate(field.contents()) if dsa]
        print(f"{name} = arr[bool, {len(field.contents())}], true on layers {marked}")
    elif name.startswith(f"{ARCH}.attention.indexer."):
        print(f"{name} = {field.contents()}")
indexer = [t for t in reader.tensors if ".indexer." in t.name]
kinds = sorted({(t.name.split(".", 2)[2], t.tensor_type.name) for t in indexer})
print(f"indexer tensors: {len(indexer)}: " + ", ".join(f"{n} {t}" for n, t in kinds))
EOF

echo "== run $GGUF on the ggml graph (greedy, 24 tokens; random weights, so the text is gibberish)"
python -m ggml_graph_spec -m "$GGUF" -p "The lighthouse keeper woke before dawn" -n 24 --temp 0 -c 256 -t 2
