"""The benches' plots: matplotlib (the bench extra) on its file-only backend, or a note that the
plot is skipped."""
from __future__ import annotations

import sys
from pathlib import Path


def pyplot(path: Path):
    """matplotlib.pyplot ready to write `path`, or None (not installed: said on stderr)."""
    try:
        import matplotlib
    except ImportError:
        print(f"plot skipped: matplotlib is not installed (pip install -e '.[bench]'); {path.name} not written",
              file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
