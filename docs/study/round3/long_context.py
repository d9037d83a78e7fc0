"""What long context changes, for the MoE and the ConceptMoE of each seed (issue 44, round 3 §2 and §4).

    python docs/study/round3/long_context.py NAME [COMPARE_DIR ...] [--keep RECORD.json ...] [--label topk-R2]

Each COMPARE_DIR is a finished (or partly finished) ``conceptmoe compare`` output; its runs'
training length (``--seq-len``) comes from their config.json, so the 2048 and the 256 pairs of a
seed can be given together. For every run it measures, on the run's own held-out split (never
seen in training, nothing tuned on it):

- ``position``: held-out BPB by position in a document. The held-out documents of at least 2048
  tokens, their first 2048 tokens each, scored in the run's own windows (one window at 2048;
  windows of 256 overlapping by one token for a 256 run, so its late positions see 256 tokens of
  context), summed per bucket of positions: [1, 64), [64, 256), [256, 512), [512, 1024),
  [1024, 2048).
- ``needle``: the needle task at 512 / 1024 / 2048 tokens (harness/tasks.py's ``niah_docs``
  built from the held-out text: "The secret word is W." at a random depth, four choices asked at
  the end), scored in the last ``seq_len`` tokens of the document (a 256 run cannot see the
  needle: its figure is the chance control). ``acc`` (chance 0.25) and ``nll``: the mean
  nats of the right word.
- ``copy``: a 64-token held-out span, then ``gap`` tokens of other held-out text, then the span
  again; BPB of the repeat (its first token left out) scored in the last ``seq_len`` tokens
  (``repeat``), beside the same tokens after the same filler with another span first
  (``control``); ``gain`` = control - repeat, what the first occurrence is worth. Gaps 64, 1024
  and 1856 (a 256 run sees the first occurrence only at gap 64).
- ``wallclock``: held-out BPB against training time (the sum of the measured step times of
  metrics.jsonl, validation excluded) and the BPB of each model at the time the faster model ended;
  with ``--speed train.json`` (``conceptmoe bench train``, both models timed interleaved on a quiet
  machine) also at that measured speed ratio: the slower model read at tokens / ratio.

``contrasts`` answer "is the ConceptMoE's gap smaller at late positions or long range?": per
seed, the gap at positions [1024, 2048) minus the gap at [1, 64) (per training length), and the
gap at 2048 minus the gap at 256 (seeds trained at both) of the held-out BPB and of the late
positions; negative = the ConceptMoE gains where the context is long.

Per-run figures are cached in RUN/long_context.json (remove it to measure again). The record
docs/study/round3/NAME.json holds every run's figures and, per training length, the paired gaps
ConceptMoE - MoE per seed with their mean and Student-t 95% interval (interval.py); NAME.md is
the same as tables.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from interval import ci_text, interval as paired  # noqa: E402

from conceptmoe.data.corpus import DOC_SEP, check_record, load_corpus  # noqa: E402
from conceptmoe.data.tokenizer import byte_lengths, encode_documents  # noqa: E402
from conceptmoe.harness.tasks import niah_docs  # noqa: E402
from conceptmoe.training.checkpoint import load_run, read_metrics  # noqa: E402
from conceptmoe.training.validation import windows  # noqa: E402

VERSION = 2  # of the probes: a cached long_context.json of another version is measured again
DOC_TOKENS = 2048  # --doc-tokens: the longest context probed (smaller only to test the script)
NEEDLE_DOCS = 24
SPAN, COPY_SPANS = 64, 32
BATCH = 8


def buckets(doc: int) -> list[tuple[int, int]]:
    """[1, 64), [64, 256), [256, 512), [512, 1024), [1024, 2048) for 2048, cut at ``doc``."""
    edges = [1] + [e for e in (64, 256, 512, 1024) if e < doc] + [doc]
    return list(zip(edges, edges[1:]))


def needle_lengths(doc: int) -> tuple[int, ...]:
    return doc // 4, doc // 2, doc  # 512, 1024, 2048


def copy_gaps(doc: int) -> tuple[int, ...]:
    return tuple(sorted({SPAN, doc // 2, doc - 3 * SPAN}))  # 64, 1024, 1856: the last fills the window


@torch.no_grad()
def token_nll(model, seqs: list[np.ndarray]) -> np.ndarray:
    """(B, T-1) nats of each next token of equal-length sequences, one forward per BATCH."""
    out = []
    for i in range(0, len(seqs), BATCH):
        x = torch.from_numpy(np.stack(seqs[i:i + BATCH]).astype(np.int64))
        logits = model(x).logits[:, :-1].float()
        out.append(F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none").double().numpy())
    return np.concatenate(out)


def position_bpb(model, docs: list[np.ndarray], seq_len: int, byte_len: np.ndarray, doc: int) -> dict:
    """Held-out BPB per bucket of positions in the document (module doc)."""
    if not docs:
        raise SystemExit(f"error: no held-out document has {doc} tokens; lower --doc-tokens")
    nll, nbytes = np.zeros(doc), np.zeros(doc)
    for ids in docs:
        for a, b in windows(len(ids), seq_len):
            loss = token_nll(model, [ids[a:b]])[0]
            nll[a + 1:b] += loss
            nbytes[a + 1:b] += byte_len[ids[a + 1:b]]
    return {f"{lo}-{hi}": nll[lo:hi].sum() / math.log(2) / nbytes[lo:hi].sum() for lo, hi in buckets(doc)}


def needle_scores(model, tok, text: str, seq_len: int, chars_per_token: float, doc: int) -> dict:
    """acc and mean nats of the right word of the needle task at each length (module doc)."""
    out = {}
    for length in needle_lengths(doc):
        right, nll = 0, []
        for d in niah_docs(text, int(length * chars_per_token), NEEDLE_DOCS, seed=44):
            ctx = d["context"]
            choices = [tok.encode(" " + c).ids for c in d["choices"]]
            while len(tok.encode(ctx).ids) + max(map(len, choices)) > length:  # whole lines off the front
                ctx = ctx[ctx.index("\n") + 1:]
            ids = tok.encode(ctx).ids
            scores = []
            for c in choices:
                seq = np.asarray(ids + c)[-seq_len:]
                scores.append(float(token_nll(model, [seq])[0][-len(c):].sum()))
            right += int(np.argmin(scores) == d["label"])
            nll.append(scores[d["label"]])
        out[str(length)] = {"acc": right / NEEDLE_DOCS, "nll": statistics.fmean(nll)}
    return out


def copy_scores(model, stream: np.ndarray, seq_len: int, byte_len: np.ndarray, doc: int) -> dict:
    """BPB of a repeated span after each gap (``repeat``), beside the same tokens after the same
    filler with another span in the first place (``control``); ``gain`` = control - repeat."""
    rng = random.Random(44)
    spans = [rng.randrange(0, len(stream) - SPAN) for _ in range(COPY_SPANS)]
    others = [rng.randrange(0, len(stream) - SPAN) for _ in range(COPY_SPANS)]
    nbytes = sum(int(byte_len[stream[s + 1:s + SPAN]].sum()) for s in spans)
    out = {}
    for gap in copy_gaps(doc):
        fills = [rng.randrange(0, len(stream) - gap) for _ in spans]
        bpb = {}
        for kind, heads in (("repeat", spans), ("control", others)):
            seqs = [np.concatenate([stream[h:h + SPAN], stream[f:f + gap], stream[s:s + SPAN]])[-seq_len:]
                    for h, f, s in zip(heads, fills, spans)]
            bpb[kind] = token_nll(model, seqs)[:, -(SPAN - 1):].sum() / math.log(2) / nbytes
        out[str(gap)] = {**bpb, "gain": bpb["control"] - bpb["repeat"]}
    return out


def wallclock(run: Path) -> list[list[float]]:
    """[training seconds, tokens, held-out BPB] at each validation of the run."""
    t, curve, last = 0.0, [], 0
    for row in read_metrics(run):
        t += (row["tokens"] - last) / row["tokens_per_s"]
        last = row["tokens"]
        if "val_bpb" in row:
            curve.append([t, row["tokens"], row["val_bpb"]])
    return curve


def at_time(curve: list[list[float]], t: float, col: int = 0) -> float:
    """Held-out BPB at training time ``t`` (``col`` 1: at ``t`` tokens), linear between validations
    (the last one past the end)."""
    for a, b in zip(curve, curve[1:]):
        if a[col] <= t <= b[col]:
            return a[2] + (b[2] - a[2]) * (t - a[col]) / (b[col] - a[col])
    return curve[-1][2] if t >= curve[-1][col] else curve[0][2]


def bench_speed(path: Path, seq_len: int) -> float | None:
    """The ConceptMoE's training tokens/s over the MoE's at ``seq_len`` in a `bench train` train.json
    (fp32, both models timed interleaved on a quiet machine), or None when it has no such row."""
    rows = [r for r in json.loads(path.read_text())["rows"] if r["seq_len"] == seq_len and r["dtype"] == "fp32"]
    cm = [r for r in rows if r["model"] != "MoE"]
    return cm[0]["ratio_vs_moe"] if cm else None


def probe(run: Path, doc: int = DOC_TOKENS) -> dict:
    """Every figure of one finished run (cached in RUN/long_context.json)."""
    cache = run / "long_context.json"
    cached = json.loads(cache.read_text()) if cache.is_file() else {}
    if cached.get("version") == [VERSION, doc]:
        return cached
    model, cfg, tok, run_cfg = load_run(run, "cpu")
    seq_len = int(run_cfg["train"]["seq_len"])
    byte_len = byte_lengths(tok, cfg.vocab_size)
    corpus = load_corpus(run_cfg["train"]["data"])
    check_record(run_cfg.get("data"), corpus.record())  # the held-out split the run was trained beside
    texts = [d.text for d in corpus.val]
    stream = encode_documents(tok, texts, DOC_SEP)
    long_docs = [np.asarray(e.ids[:doc]) for e in tok.encode_batch(texts) if len(e.ids) >= doc]
    text = DOC_SEP.join(texts)
    res = {"version": [VERSION, doc], "seq_len": seq_len, "documents": len(long_docs),
           "val_bpb": json.loads((run / "eval.json").read_text())["val_bpb"],
           "position": position_bpb(model, long_docs, seq_len, byte_len, doc),
           "needle": needle_scores(model, tok, text, seq_len, len(text) / len(stream), doc),
           "copy": copy_scores(model, stream, seq_len, byte_len, doc),
           "wallclock": wallclock(run), "environment": run_cfg.get("environment", {}).get("start")}
    cache.write_text(json.dumps(res, indent=1, allow_nan=False))
    return res


def gap(gaps: list[float], key: str = "") -> dict:
    """interval.py's paired interval; its verdict reads lower as better, so an accuracy or a gain has none."""
    res = paired(gaps)
    if key.endswith(("acc", "gain")):
        res["verdict"] = "higher is better: no verdict"
    return res


def figures(r: dict) -> dict[str, float]:
    """The flat figures a gap is taken of."""
    out = {"val_bpb": r["val_bpb"]}
    out.update({f"position {k}": v for k, v in r["position"].items()})
    out.update({f"needle {k} nll": v["nll"] for k, v in r["needle"].items()})
    out.update({f"needle {k} acc": v["acc"] for k, v in r["needle"].items()})
    out.update({f"copy {k}": v["repeat"] for k, v in r["copy"].items()})
    out.update({f"copy {k} gain": v["gain"] for k, v in r["copy"].items()})
    return out


LATE, EARLY = "position 1024-2048", "position 1-64"


def contrast(diffs: list[float]) -> dict:
    """A paired interval over per-seed differences of gaps; negative = the ConceptMoE's gap shrinks."""
    res = paired(diffs)
    lo, hi = res["ci95"]
    res["verdict"] = ("unresolved" if lo is None else "smaller (ConceptMoE gains)" if hi < 0
                      else "larger (ConceptMoE loses)" if lo > 0 else "unresolved")
    return res


def contrasts(runs: dict[int, dict[int, dict]], lab: str) -> dict[str, dict]:
    """Late-minus-early gap per training length; 2048-minus-256 gap over the seeds trained at both."""
    def g(m: dict, k: str) -> float:
        return figures(m[lab])[k] - figures(m["moe"])[k]
    pairs = {L: {s: m for s, m in by.items() if len(m) == 2} for L, by in runs.items()}
    pairs = {L: by for L, by in pairs.items() if by and LATE in figures(next(iter(by.values()))["moe"])}
    out = {f"late - early gap at {L}": contrast([g(m, LATE) - g(m, EARLY) for m in by.values()])
           for L, by in sorted(pairs.items())}
    if 2048 in pairs and 256 in pairs:
        both = sorted(set(pairs[2048]) & set(pairs[256]))
        for k in ("val_bpb", LATE):
            out[f"{k} gap at 2048 - at 256"] = dict(contrast([g(pairs[2048][s], k) - g(pairs[256][s], k)
                                                              for s in both]), seeds=both)
    return out


def markdown(record: dict) -> str:
    """Every figure of the record: per training length, the models' means over paired seeds and the gap."""
    lab, out = record["label"], []
    for L, gaps in record["gaps"].items():
        pairs = [m for m in record["runs"][L].values() if len(m) == 2]
        wc = list(record["wallclock"][L].values())
        out += [f"### Trained at {L} tokens per sequence ({len(pairs)} paired seeds)", "",
                f"| figure | MoE | {lab} | paired gap | 95% interval | answer |", "|---|---|---|---|---|---|"]
        for k, g in gaps.items():
            if k.startswith("equal wall-clock"):
                pick = (lambda w: w["bench"]) if k.endswith("(bench)") else (lambda w: w)
                moe = statistics.fmean(pick(w)["bpb"]["moe"] for w in wc)
                cm = statistics.fmean(pick(w)["bpb"][lab] for w in wc)
            else:
                moe = statistics.fmean(figures(m["moe"])[k] for m in pairs)
                cm = statistics.fmean(figures(m[lab])[k] for m in pairs)
            out.append(f"| {k} | {moe:.4f} | {cm:.4f} | {g['mean']:+.4f} | {ci_text(g)} | {g['verdict']} |")
        out.append("")
    if record.get("contrasts"):
        out += ["### Is the ConceptMoE's gap smaller where the context is long?", "",
                "Per seed, a difference of paired gaps (ConceptMoE - MoE); negative: the ConceptMoE does "
                "relatively better at the later positions / the longer training length.", "",
                "| contrast | seeds | mean | 95% interval | answer |", "|---|---|---|---|---|"]
        for k, c in record["contrasts"].items():
            out.append(f"| {k} | {c['n']} | {c['mean']:+.4f} | {ci_text(c)} | {c['verdict']} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("compares", nargs="*", type=Path)
    ap.add_argument("--label", default="topk-R2", help="the ConceptMoE's label in the compares")
    ap.add_argument("--doc-tokens", type=int, default=DOC_TOKENS, help="the longest context probed (default 2048)")
    ap.add_argument("--record-dir", type=Path, default=HERE, help="where NAME.json goes (default: beside this script)")
    ap.add_argument("--speed", type=Path, help="a `conceptmoe bench train` train.json: equal time also at its "
                                               "measured speed ratio (the runs' own step times share a busy machine)")
    ap.add_argument("--keep", type=Path, action="append", default=[],
                    help="an earlier record whose runs count too (runs whose directories are gone); a run found "
                         "again here replaces its kept figures")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    runs: dict[int, dict[int, dict[str, dict]]] = {}  # seq_len -> seed -> model -> figures
    speeds: dict[str, float] = {}  # seq_len -> the ConceptMoE's bench speed over the MoE's
    for kept in a.keep:
        speeds.update(json.loads(kept.read_text()).get("bench_speed", {}))
        for L, by in json.loads(kept.read_text())["runs"].items():
            for s, models in by.items():
                runs.setdefault(int(L), {}).setdefault(int(s), {}).update(models)
    for comp in a.compares:
        for label in ("moe", a.label):
            for run in sorted((comp / label).glob("seed*")):
                if (run / "eval.json").is_file():
                    r = probe(run, a.doc_tokens)
                    runs.setdefault(r["seq_len"], {}).setdefault(int(run.name[4:]), {})[label] = r
                    print(f"{run}: {r['val_bpb']:.4f}", flush=True)
    record = {"label": a.label, "runs": {str(L): {str(s): m for s, m in sorted(by.items())}
                                         for L, by in sorted(runs.items())}, "gaps": {}, "wallclock": {},
              "bench_speed": speeds}
    for L, by in sorted(runs.items()):
        pairs = {s: m for s, m in by.items() if len(m) == 2}
        keys = figures(next(iter(pairs.values()))["moe"]) if pairs else {}
        record["gaps"][str(L)] = {k: gap([figures(m[a.label])[k] - figures(m["moe"])[k] for m in pairs.values()], k)
                                  for k in keys}
        wc = {}
        for s, m in pairs.items():
            ends = {lab: m[lab]["wallclock"][-1][0] for lab in ("moe", a.label)}
            t = min(ends.values())
            wc[str(s)] = {"seconds": ends, "at_seconds": t,
                          "bpb": {lab: at_time(m[lab]["wallclock"], t) for lab in ("moe", a.label)}}
        if a.speed and bench_speed(a.speed, L) is not None:
            speeds[str(L)] = bench_speed(a.speed, L)
        speed = speeds.get(str(L))
        if speed is not None:  # the faster model's whole budget against the slower one's curve at the same time
            for s, m in pairs.items():
                fast, slow = (a.label, "moe") if speed >= 1 else ("moe", a.label)
                end = m[fast]["wallclock"][-1][1]
                wc[str(s)]["bench"] = {"speed": speed, "tokens": {fast: end, slow: end / max(speed, 1 / speed)},
                                       "bpb": {fast: m[fast]["wallclock"][-1][2],
                                               slow: at_time(m[slow]["wallclock"], end / max(speed, 1 / speed), 1)}}
        record["wallclock"][str(L)] = wc
        if wc:
            record["gaps"][str(L)]["equal wall-clock"] = gap([w["bpb"][a.label] - w["bpb"]["moe"] for w in wc.values()])
        if speed is not None:
            record["gaps"][str(L)]["equal wall-clock (bench)"] = gap(
                [w["bench"]["bpb"][a.label] - w["bench"]["bpb"]["moe"] for w in wc.values()])
    record["contrasts"] = contrasts(runs, a.label)
    path = a.record_dir / f"{a.name}.json"
    path.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
    path.with_suffix(".md").write_text(markdown(record))
    for L, gaps in record["gaps"].items():
        print(f"\nseq_len {L}: gap {a.label} - moe")
        for k, g in gaps.items():
            print(f"  {k:24s} n={g['n']}  {g['mean']:+.4f}  95% CI {ci_text(g)}  {g['verdict']}")
    for k, c in record["contrasts"].items():
        print(f"{k:38s} n={c['n']}  {c['mean']:+.4f}  95% CI {ci_text(c)}  {c['verdict']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
