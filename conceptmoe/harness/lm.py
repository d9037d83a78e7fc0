"""``ConceptMoEHarnessLM``: our models as an lm-evaluation-harness ``LM`` (issue 11 B, issue 19).

A ``TemplateLM`` (so requests are split into context and continuation tokens exactly as the
harness's own ``HFLM`` does) that calls our model's forward pass for log-likelihoods and our
KV-cached ``stream`` for ``generate_until``. It follows ``HFLM``'s conventions, so that
``lm_eval --model hf --model_args pretrained=EXPORT,trust_remote_code=True`` on an ``export-hf``
folder gives what ``conceptmoe eval RUN --tasks`` gives, with no hand-set arguments:

- the prefix token (before a document, ``prefix_token_id``) is BOS, else EOS, read from the run
  (``training/conventions.py``: the tokenizer's ``<|endoftext|>``, or an imported source's ids);
  runs without either (tokenizers made before special tokens) fall back to the last token of
  ``DOC_SEP``, what separated their training documents (pass the export's ``prefix_token_id``
  to ``hf`` for those);
- ``max_length`` is the model's maximum length (``max_position_embeddings`` of an imported
  checkpoint, else the training length, else 2048), the one length ``HFLM`` uses to truncate
  ``loglikelihood`` contexts on the left and to cut ``loglikelihood_rolling`` windows
  (``get_rolling_token_windows`` with ``context_len=1``: windows of ``max_length`` tokens);
- ``loglikelihood``: input = (context + continuation)[-(max_length + 1):][:-1], right-padded
  batches, sum of log-softmax at the continuation positions, and whether it is the greedy one;
- ``generate_until``: requests with the same generation arguments run as one left-padded batch;
  each row stops at EOS or once its text holds a stop string (``until``, default ``DOC_SEP``),
  and the text is cut at the first stop string.

Windows versus ``conceptmoe eval`` (``evaluation/evaluate.py``): ``max_length`` L gives windows
of L input tokens over the stream ``[prefix] + tokens`` sharing one token, i.e. ``evaluate``'s
windows at seq_len L + 1 (tested); ``evaluate`` itself reads the held-out documents joined by
end-of-text (or ``DOC_SEP``) from their first token, so the two BPBs differ slightly.
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

from ..data.corpus import DOC_SEP
from ..inference.generate import stream
from ..training.checkpoint import load_run
from ..training.conventions import DEFAULT_MAX_LENGTH, eos_list, max_length as run_max_length, prefix_id, token_ids


@register_model("conceptmoe")
class ConceptMoEHarnessLM(TemplateLM):
    """Our MoE / ConceptMoE model behind the harness API; ``run=`` or ``model=`` + ``tokenizer=``.

    ``max_length`` / ``prefix_token_id`` override the run's (see the module docstring), as the
    same ``--model_args`` do for ``hf``; with ``model=`` they default to 2048 / EOS or ``DOC_SEP``.
    """

    def __init__(self, run: str | None = None, model: torch.nn.Module | None = None, tokenizer=None,
                 device: str = "cpu", batch_size: int | str = 16, max_length: int | None = None,
                 prefix_token_id: int | None = None, concept_ratio: float | None = None,
                 extrapolate: bool = False, **kwargs: Any) -> None:
        super().__init__()
        run_cfg: dict = {}
        if run is not None:
            model, _, tokenizer, run_cfg = load_run(run, device)
        if model is None or tokenizer is None:
            raise ValueError("ConceptMoEHarnessLM needs run= or model= and tokenizer=")
        self.model, self.tokenizer = model.eval(), tokenizer
        # An elastic ConceptMoE's R (``--model_args concept_ratio=R``; None: its design ratio),
        # outside the trained range only with ``extrapolate`` (checked now, not at the first request).
        self._at = {} if concept_ratio is None else {"ratio": float(concept_ratio), "extrapolate": bool(extrapolate)}
        if self._at:
            from ..model.elastic import check_ratio

            why = check_ratio(model.cfg, [self._at["ratio"]], self._at["extrapolate"], flag="concept_ratio")
            if why:
                raise ValueError(why)
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 16
        self._max_length = int(max_length) if max_length else run_max_length(run_cfg) if run_cfg else DEFAULT_MAX_LENGTH
        ids = token_ids(run_cfg, tokenizer)
        self._eos = eos_list(ids)
        self._prefix = int(prefix_token_id) if prefix_token_id is not None else prefix_id(ids, tokenizer)

    @property
    def eot_token_id(self) -> int:
        return self._eos[0] if self._eos else self._prefix  # no EOS: the document separator ends a text

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
            logp = F.log_softmax(self.model(ids, **self._at).logits.float(), dim=-1)  # (b, T, V)
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
                max_seq_len=self.max_length, context_len=1)]
            total = sum(ll for ll, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows], True))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with ``do_sample`` and ``temperature``) text until a stop string or EOS,
        batched: requests with equal generation arguments, longest contexts first."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(dict(req.args[1]).items())), []).append(i)
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="conceptmoe generate", leave=False)
        for idx in groups.values():
            gen = dict(requests[idx[0]].args[1])
            until = gen.get("until") or [DOC_SEP]
            until = [until] if isinstance(until, str) else [u for u in until if u]
            n = int(gen.get("max_gen_toks", 256))
            temp = float(gen.get("temperature", 0.0)) if gen.get("do_sample", False) else 0.0
            ctx = {i: self.tok_encode(requests[i].args[0])[-max(self.max_length - n, 1):] or [self.prefix_token_id]
                   for i in idx}
            order = sorted(idx, key=lambda i: -len(ctx[i]))
            for at in range(0, len(order), self.batch_size):
                chunk = order[at:at + self.batch_size]
                for i, text in zip(chunk, self._generate_batch([ctx[i] for i in chunk], n, temp, until)):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], n: int, temperature: float, until: list[str]) -> list[str]:
        """Left-padded batch through the KV-cached ``stream``; a row is done at EOS or a stop string."""
        T = max(map(len, prompts))
        ids = torch.zeros(len(prompts), T, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, T - len(p):], mask[row, T - len(p):] = torch.tensor(p, device=self.device), 1
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for step in stream(self.model, ids, n, temperature, eos_token_id=self._eos or None, attention_mask=mask,
                           **self._at):
            for row, t in enumerate(step.tokens.tolist()):
                if done[row]:
                    continue
                if bool(step.finished[row]):
                    done[row] = True
                    continue
                new[row].append(t)
                done[row] = any(u in self.tok_decode(new[row]) for u in until)
            if all(done):
                break
        texts = []
        for toks in new:
            text = self.tok_decode(toks)
            for stop in until:
                if stop in text:
                    text = text[:text.index(stop)]
            texts.append(text)
        return texts
