"""K3 as an agent: the reply parser (channels and tool calls), tool declarations, the grammars and
the per-sequence constraints of constrained decoding (llguidance)."""
