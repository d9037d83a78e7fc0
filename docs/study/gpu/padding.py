"""How much padding a batch's concept tensor carries: each row's concepts are padded to the batch's
longest row (and, on CUDA, to a multiple of 64), so the concept layers' attention and dense parts
work on more than the real concepts. This measures it with a trained ConceptMoE on held-out text, training-mode boundaries
(with the boundary noise), one forward of the encoder and router per batch.

    python docs/study/gpu/padding.py RUN --out docs/study/gpu/padding.json [--batches 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from conceptmoe.data.corpus import load_corpus
from conceptmoe.model.chunking import boundaries, padded_count
from conceptmoe.training.checkpoint import load_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a trained ConceptMoE run folder")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--bucket", type=int, default=64, help="the CUDA rounding of the concept count")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    model, cfg, tok, run_cfg = load_run(a.run, "cpu")
    if not cfg.is_concept:
        sys.exit(f"error: {a.run} is not a ConceptMoE")
    torch.manual_seed(a.seed)
    data = run_cfg["data"]["source"]
    ids = torch.tensor(tok.encode(load_corpus(data).val_text).ids)
    B, T = a.batch_size, a.seq_len
    starts = torch.randint(0, len(ids) - T, (a.batches, B))
    rows = []
    with torch.no_grad():
        for k in range(a.batches):
            x = torch.stack([ids[s:s + T] for s in starts[k].tolist()])
            h, _ = model.encode(x, None)
            p = model.route(h, None)
            c = boundaries(p, True, cfg.boundary_noise, cfg.boundary_sharpness_final, None).sum(1).float()
            longest = int(c.max())
            bucketed = padded_count(longest, a.bucket, T)
            rows.append({"mean": float(c.mean()), "min": int(c.min()), "max": longest,
                         "padded_over_real": longest * B / float(c.sum()),
                         "bucketed_over_real": bucketed * B / float(c.sum())})
            print(f"batch {k}: concepts per row mean {c.mean():.0f}, min {c.min():.0f}, max {longest}; "
                  f"padded / real {rows[-1]['padded_over_real']:.3f}, with the bucket {rows[-1]['bucketed_over_real']:.3f}")
    rec = {"run": str(a.run), "data": data, "batch_size": B, "seq_len": T, "bucket": a.bucket, "seed": a.seed,
           "batches": rows,
           "mean_padded_over_real": sum(r["padded_over_real"] for r in rows) / len(rows),
           "mean_bucketed_over_real": sum(r["bucketed_over_real"] for r in rows) / len(rows)}
    a.out.write_text(json.dumps(rec, indent=2, allow_nan=False) + "\n")
    print(f"mean padded / real {rec['mean_padded_over_real']:.3f}, with the bucket {rec['mean_bucketed_over_real']:.3f}; wrote {a.out}")


if __name__ == "__main__":
    main()
