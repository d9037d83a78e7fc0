"""``ConceptMoEHarnessLM``: our models as an lm-evaluation-harness ``LM`` (issue 11 B).

A ``TemplateLM`` (so requests are split into context and continuation tokens exactly as the
harness's own ``HFLM`` does) that calls our model's forward pass for log-likelihoods and
``model.generate`` for ``generate_until``. It reproduces ``HFLM`` request by request:

- ``loglikelihood``: input = (context + continuation)[-(max_length + 1):][:-1], right-padded
  batches, sum of log-softmax at the continuation positions, and whether it is the greedy one;
- ``loglikelihood_rolling``: the harness's rolling windows (``get_rolling_token_windows`` with
  ``context_len=1``) of ``rolling_len`` predicted tokens after ``prefix_token_id``.

Windows versus ``conceptmoe eval`` (``training/evaluate.py``): with ``rolling_len = seq_len - 1``
(the default: the run's training length) every window is seq_len tokens and consecutive windows
share one token, exactly like ``evaluate``'s windows over the stream ``[prefix] + tokens``; the
rolling log-likelihood of a document therefore equals minus ``evaluate_tokens``' summed NLL over
that stream (tested) except in the last, partial window, which the harness gives a full-length
context and ``evaluate`` a short one. ``conceptmoe eval`` itself starts at the text's first token
instead of the prefix, so the two also differ by that first token's prediction and a one-token
shift of the window starts: on the held-out plays the BPBs agree to about 1e-4 (README). ``prefix_token_id`` defaults to the last token of the document separator
(``DOC_SEP``): what precedes every document in training (our models have no BOS token).

``max_length`` (default 8192) only bounds ``loglikelihood`` contexts (left truncation, as HFLM):
the needle task runs past the training length on purpose.
"""

from __future__ import annotations

from typing import Any

import lm_eval.models  # noqa: F401  (fills the harness's model registry before we add ours: "hf" stays known)
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from ..training.checkpoint import load_run
from ..data.corpus import DOC_SEP

MAX_LENGTH = 8192


@register_model("conceptmoe")
class ConceptMoEHarnessLM(TemplateLM):
    """Our MoE / ConceptMoE model behind the harness API; ``run=`` or ``model=`` + ``tokenizer=``."""

    def __init__(self, run: str | None = None, model: torch.nn.Module | None = None, tokenizer=None,
                 seq_len: int | None = None, device: str = "cpu", batch_size: int | str = 16,
                 max_length: int = MAX_LENGTH, prefix_token_id: int | None = None,
                 rolling_len: int | None = None, **kwargs: Any) -> None:
        super().__init__()
        if run is not None:
            model, _, tokenizer, run_cfg = load_run(run, device)
            seq_len = seq_len or int(run_cfg.get("train", {}).get("seq_len", 256))
        if model is None or tokenizer is None:
            raise ValueError("ConceptMoEHarnessLM needs run= or model= and tokenizer=")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 16
        self._max_length = int(max_length)
        self.rolling_len = int(rolling_len or (seq_len or 256) - 1)
        sep = tokenizer.encode(DOC_SEP).ids
        self._prefix = int(prefix_token_id) if prefix_token_id is not None else sep[-1]

    @property
    def eot_token_id(self) -> int:
        return self._prefix  # no EOS token: the document separator ends a text

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tok_encode(self, string: str, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string).ids

    def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(tokens)

    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), continuation is greedy) per (key, context, continuation)."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for at in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm or len(order) <= self.batch_size,
                       desc="conceptmoe loglikelihood", leave=False):
            chunk = order[at:at + self.batch_size]
            inps = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in chunk]
            ids = torch.zeros(len(chunk), max(map(len, inps)), dtype=torch.long, device=self.device)
            for row, inp in enumerate(inps):
                ids[row, :len(inp)] = torch.tensor(inp, device=self.device)
            logp = F.log_softmax(self.model(ids).logits.float(), dim=-1)  # (b, T, V)
            for row, i in enumerate(chunk):
                cont = torch.tensor(requests[i][2], device=self.device)
                n = len(inps[row])
                lp = logp[row, n - len(cont):n]  # (len(cont), V): positions predicting the continuation
                res = (float(lp.gather(1, cont[:, None]).sum()), bool((lp.argmax(-1) == cont).all()))
                out[i] = res
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], res)
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="conceptmoe rolling", leave=False):
            (string,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.rolling_len, context_len=1)]
            total = sum(ll for ll, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows], True))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with ``do_sample`` and ``temperature``) text until a stop string."""
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="conceptmoe generate", leave=False):
            context, gen = req.args
            gen = dict(gen)
            until = gen.get("until") or [DOC_SEP]
            until = [until] if isinstance(until, str) else list(until)
            n = int(gen.get("max_gen_toks", 256))
            temp = float(gen.get("temperature", 0.0)) if gen.get("do_sample", False) else 0.0
            ids = self.tok_encode(context)[-max(self.max_length - n, 1):] or [self.prefix_token_id]
            x = torch.tensor([ids], device=self.device)
            new = self.model.generate(x, n, temperature=temp)[0, len(ids):].tolist()
            text = self.tok_decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
            out.append(text)
        return out
