"""`python -m ggml_graph_spec`: the kimi-k3-cli runner."""
import sys

from .runner.cli import main

sys.exit(main())
