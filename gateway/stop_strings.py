"""Stop strings applied to a stream of text deltas (OpenAI / vLLM semantics)."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Truncates a text stream right before the first stop string and holds back possible starts.

    The stream stops at the first place where a stop string is complete, as if the text arrived one
    character at a time; when several complete at the same character, the one that starts first
    wins. The result does not depend on how the text is split into deltas. A suffix that could still
    become a stop string (at most ``max(len(s)) - 1`` characters) is held until it is decided.
    """

    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        """``include_stop``: the emitted text ends with the stop string that stopped it."""
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single string")
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}")
            if not s:
                raise ValueError("stop strings must not be empty")
        self._stop = tuple(dict.fromkeys(stop))
        self._held = ""
        self._stopped = False
        self._matched: str | None = None
        self._include_stop = include_stop

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been found."""
        return self._stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the stream, or None."""
        return self._matched

    @property
    def held(self) -> str:
        """Text received but not yet emitted because it may be the start of a stop string."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add generated text; return (text safe to emit now, whether the stream has stopped)."""
        if self._stopped:
            return "", True
        if not self._stop:
            return delta, False
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self._held = ""
            self._stopped = True
            self._matched = stop
            return text[: start + len(stop) if self._include_stop else start], True
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Release the held text at the end of a stream that did not stop."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            start = text.find(s)
            if start < 0:
                continue
            candidate = (start + len(s), start, s)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, text: str) -> int:
        longest = 0
        for s in self._stop:
            for size in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:size]):
                    longest = size
                    break
        return longest
