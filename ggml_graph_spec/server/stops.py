"""Stop strings as OpenAI applies them: the reply ends before the first stop string and never
shows it, even in a stream, where text that may be the start of one is held back until the next
token says whether it is."""
from __future__ import annotations


class StopText:
    """The text of one reply, released as it becomes safe to show."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._held = ""  # text not released yet: it may begin a stop string
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the reply

    def push(self, piece: str) -> str:
        """The text `piece` makes safe to show (nothing once a stop string was seen)."""
        if self.stopped:
            return ""
        text = self._held + piece
        hits = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if hits:
            cut, self.matched = min(hits)
            self.stopped, self._held = True, ""
            return text[:cut]
        keep = max((_overlap(text, s) for s in self._stops), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The end of the reply: what was held back was not a stop string after all."""
        text, self._held = self._held, ""
        return "" if self.stopped else text


def _overlap(text: str, stop: str) -> int:
    """The longest end of `text` that is a beginning of `stop` (shorter than it)."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
