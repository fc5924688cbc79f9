"""K3's think channel as the runners offer it: the reasoning formats, the efforts by the names
OpenAI's and llama.cpp's clients use, the budget's bound, and which channel a rendered
generation prompt leaves open. kimi-k3-cli's flags and the server's request fields read them here."""
from __future__ import annotations

from gguf_arch.arch import xtml

REASONING_FORMATS = ("auto", "deepseek", "deepseek-legacy", "none")
# K3's thinking_effort for each level (OpenAI's and llama.cpp's names too); None: thinking off.
EFFORTS: dict[str, str | None] = {"none": None, "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                                  "xhigh": "max", "max": "max"}
MAX_BUDGET = 1 << 20  # think tokens a budget may allow


def reply_start(prompt_text: str) -> str:
    """The channel a rendered generation prompt leaves open: think or response (K3's template,
    thinking on or off), or text (a template that is not K3's: the whole reply is its answer)."""
    return next((c for c in (xtml.THINK, xtml.RESPONSE) if prompt_text.endswith(xtml.opening(c))), "text")
