"""Synthetic Kimi K3 / K3.1-Pro checkpoints in the released on-disk format (`kimi-k3-synth`)."""
