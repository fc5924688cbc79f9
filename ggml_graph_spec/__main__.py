"""`python -m ggml_graph_spec`: the kimi-k3-cli runner."""
import sys

from .cli import main

sys.exit(main())
