"""Where the tests find their data: everything lives inside the repository (tests/fixtures/).

A user's clone has nothing beside it, so no test reads a path outside the repository
(tests/test_self_contained.py checks that no file spells one).
"""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
K3_TINY = FIXTURES / "k3-tiny"
K31PRO_TINY = FIXTURES / "k31pro-tiny"
REFERENCE = FIXTURES / "reference"
VISION = K31PRO_TINY / "vision"  # the vision path's reference outputs (vision_reference.npz, the images)
PROSE = FIXTURES / "text" / "prose.txt"  # calibration texts with two tags (prose, code)
CODE = FIXTURES / "text" / "code.txt"
TEXT = FIXTURES / "text" / "lighthouse.txt"  # prose for perplexity and importance matrices
