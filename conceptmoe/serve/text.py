"""Completion tokens to text for the server: incremental decoding, stop strings, concept offsets.

``TextTracker`` receives the engine's events for one choice and says what text to send. Text is
decoded incrementally, as vLLM does: each new token decodes a short window (the tokens since the
last committed piece, and that piece as context), never the whole completion. A token that ends
mid-character (a byte-level token; it decodes to U+FFFD) commits nothing until the character is
complete. What is sent holds back the longest tail that could still begin a stop string; when a
stop string appears, the text is cut before it and the choice is over (finish reason ``stop``).
So a stream sends exactly what the non-streamed answer returns, multi-byte stop strings included.

``count`` is the number of completion tokens the returned text stands for: up to and including
the token that completed a stop string (tokens the engine produced after it are not counted).
Concept boundaries are completion token indices (``engine.py``); ``offset(j)`` is where token j
starts in the completion text, which is what the playground marks; ``char_offsets`` gives the same
for a prompt's tokens (logprobs' ``text_offset`` with ``echo``).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextTracker:
    def __init__(self, tok, stops: list[str], min_tokens: int = 0) -> None:
        self.tok, self.stops, self.min_tokens = tok, stops, min_tokens
        self.ids: list[int] = []
        self.text = ""  # decoded completion so far (cut at a stop string once one is met)
        self.sent = 0  # characters of ``text`` already sent
        self.checked = 0  # characters of ``text`` searched for stop strings
        self.stopped = False
        self._prefix = self._read = 0  # token window: [prefix, read) is context, [read, ...) is new
        self._offsets: list[int] = []  # per token: where it starts in ``text``

    @property
    def count(self) -> int:
        return len(self.ids)

    def _decode_new(self, final: bool) -> None:
        """Commit the text of tokens [read, ...) once it is complete (or at the end, as it is)."""
        context = self.tok.decode(self.ids[self._prefix:self._read])
        whole = self.tok.decode(self.ids[self._prefix:])
        if len(whole) > len(context) and (final or not whole.endswith(REPLACEMENT)):
            self.text += whole[len(context):]
            self._prefix, self._read = self._read, len(self.ids)

    def add(self, tokens: list[int], final: bool = False) -> None:
        if self.stopped:
            return
        for t in tokens:
            self._offsets.append(len(self.text))
            self.ids.append(t)
            self._decode_new(False)
            self._find_stop()
            if self.stopped:
                return
        if final:
            self._decode_new(True)
            self._find_stop()

    def _find_stop(self) -> None:
        if len(self.ids) < self.min_tokens:  # vLLM: no stop string before min_tokens
            self.checked = len(self.text)
            return
        cut = None
        for s in self.stops:
            i = self.text.find(s, max(0, self.checked - len(s) + 1))
            if i >= 0 and (cut is None or i < cut):
                cut = i
        self.checked = len(self.text)
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True

    def _held(self) -> int:
        """Characters at the end of ``text`` that could be the start of a stop string."""
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def pending(self, final: bool = False) -> str:
        """Text that can be sent now (all of it when ``final``); marks it sent."""
        if final and not self.stopped:
            self.add([], final=True)
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held()
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def offset(self, j: int) -> int:
        """Character offset in the completion text where completion token j starts."""
        return self._offsets[j] if j < len(self._offsets) else len(self.text)

    def offsets(self, indices: list[int]) -> list[int]:
        """Offsets of those indices that fall inside the (possibly cut) text."""
        return [o for o in (self.offset(j) for j in indices if j < len(self.ids)) if o < len(self.text)]


def char_offsets(tok, ids: list[int]) -> list[int]:
    """Where each of ``ids`` starts in their decoded text, in characters (not bytes: the byte tokens
    of one multi-byte character all start where the character does), decoded as ``TextTracker`` does."""
    t = TextTracker(tok, [])
    t.add(ids, final=True)
    return [t.offset(j) for j in range(len(ids))]
