"""One choice of a completion: its engine request's events become OpenAI's text and logprobs.

A completion has ``n`` choices per prompt (``index`` = prompt number x n + choice number), each
its own engine ``Request`` (``request.py``) and ``TextTracker`` (``text.py``). ``Choice.take``
reads the choice's next event: text to send (held back near a possible stop string), the
log-probabilities of its tokens, and whether the choice is over (a finish reason from the engine,
or a stop string met in the text: the request is then cancelled in the engine).

``logprobs`` has OpenAI's legacy completions shape: ``tokens``, ``token_logprobs``,
``top_logprobs`` (each a token -> logprob map of the k best plus the chosen token) and
``text_offset`` (where each token starts in the returned text, in characters: the tokens of
one multi-byte character all start where it does); with ``echo`` the prompt's tokens come
first, the first of them with ``None`` (it has no context), which is what lm-eval's
loglikelihood tasks read.
"""

from __future__ import annotations

from .request import Event, Request
from .text import TextTracker, char_offsets


class Choice:
    def __init__(self, index: int, req: Request, tok, stops: list[str], prompt_text: str | None,
                 logprobs: bool) -> None:
        self.index, self.req, self.tok = index, req, tok
        self.tracker = TextTracker(tok, stops, req.min_tokens)
        self.prompt_text = prompt_text  # sent before the completion when echo is asked
        self.want_logprobs = logprobs
        self.entries: list[tuple[int, float | None, list | None, int]] = []  # (token, logprob, top, text_offset)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.echoed = False
        self.last: Event | None = None  # the event taken last

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def _lp_obj(self, entries: list) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top, offset in entries:
            s = self.tok.decode([t])
            out["tokens"].append(s)
            out["token_logprobs"].append(lp)
            out["text_offset"].append(offset)
            if top is None:
                out["top_logprobs"].append(None)
            else:
                d = {self.tok.decode([i]): v for i, v in top}
                d.setdefault(s, lp)
                out["top_logprobs"].append(d)
        return out

    def take(self, ev: Event, cancel) -> tuple[str, dict | None]:
        """Read ``ev``: (text to send now, logprobs of this event's tokens or None). Marks the
        choice done on a finish or a stop string (then ``cancel(req)`` stops its engine request)."""
        self.last = ev
        if self.done:
            return "", None
        before = self.tracker.count
        self.tracker.add(ev.tokens)
        if ev.error or ev.finish_reason in ("error", "cancelled"):
            self.finish_reason, self.error = ev.finish_reason or "error", ev.error
            return "", None
        if self.tracker.stopped:
            if ev.finish_reason is None:
                cancel(self.req)
            self.finish_reason = "stop"
        elif ev.finish_reason:
            self.finish_reason = ev.finish_reason
        entries = []
        if self.prompt_text is not None and not self.echoed and ev.prompt_logprobs is not None:
            offsets = char_offsets(self.tok, self.req.prompt)
            entries += [(t, None, None, o) if e is None else (t, e[0], e[1], o)
                        for t, e, o in zip(self.req.prompt, ev.prompt_logprobs, offsets)]
        base = len(self.prompt_text or "")  # completion offsets count from the end of the echoed prompt
        new = ev.tokens[:self.tracker.count - before]
        for j, (t, e) in enumerate(zip(new, ev.logprobs or [None] * len(new)), start=before):
            o = base + self.tracker.offset(j)
            entries.append((t, None, None, o) if e is None else (t, e[0], e[1], o))
        self.entries += entries
        text = self.tracker.pending(final=self.done)
        if self.prompt_text is not None and not self.echoed:
            text, self.echoed = self.prompt_text + text, True
        return text, (self._lp_obj(entries) if self.want_logprobs else None)

    def answer(self) -> dict:
        """The choice of a non-streamed response (every event taken)."""
        text = (self.prompt_text or "") + self.tracker.text
        lp = self._lp_obj(self.entries) if self.want_logprobs else None
        return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": self.finish_reason}
