"""Completion tokens to text for the server: incremental decoding, stop strings, concept offsets.

``TextTracker`` receives the engine's events for one request and says what text to send: the
text of the completion so far, minus what was already sent, minus a tail that could still become
a stop string or is an incomplete UTF-8 character (a byte-level token can end mid-character,
which decodes to U+FFFD until the next token completes it). When a stop string appears, the text
is cut before it and the request is over (finish reason ``stop``).

Concept boundaries are completion token indices (``engine.py``); ``offset(j)`` is where token j
starts in the completion text, which is what the playground marks.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextTracker:
    def __init__(self, tok, stops: list[str]) -> None:
        self.tok, self.stops = tok, stops
        self.ids: list[int] = []
        self.text = ""  # decoded completion so far (cut at a stop string once one is met)
        self.sent = 0  # characters of ``text`` already sent
        self.stopped = False
        self._offsets: dict[int, int] = {}

    def add(self, tokens: list[int]) -> None:
        if self.stopped or not tokens:
            return
        self.ids += tokens
        self.text = self.tok.decode(self.ids)
        for s in self.stops:
            i = self.text.find(s, max(0, self.sent - len(s)))
            if i >= 0:
                self.text, self.stopped = self.text[:i], True

    def pending(self, final: bool = False) -> str:
        """Text that can be sent now (all of it when ``final``); marks it sent."""
        end = len(self.text)
        if not final and not self.stopped:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            end -= hold
            while end > self.sent and self.text[end - 1:end] == REPLACEMENT:
                end -= 1
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def offset(self, j: int) -> int:
        """Character offset in the completion text where completion token j starts."""
        if j not in self._offsets:
            self._offsets[j] = len(self.tok.decode(self.ids[:j])) if j else 0
        return self._offsets[j]

    def offsets(self, indices: list[int]) -> list[int]:
        """Offsets of those indices that fall inside the (possibly cut) text."""
        return [o for o in (self.offset(j) for j in indices if j < len(self.ids)) if o < len(self.text)]
