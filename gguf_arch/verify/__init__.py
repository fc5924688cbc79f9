"""The independent check of a conversion: the tensor diff (`kimi-k3-diff`), its reference forms
and error bounds, and `--verify` (manifest digests, then the diff)."""
