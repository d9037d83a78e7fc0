"""The vision-language digits task, offline (CONCEPTMOE.md §5, vision-language).

Images: scikit-learn's 1,797 handwritten digits (8x8, 17 grey levels), read straight from the
``digits.csv.gz`` the package ships (``pip install -e ".[vlm]"``; scikit-learn itself is never
imported). A fixed seeded permutation holds out ``N_HELD_OUT`` images; training sequences are
built from the other images only, evaluation sequences from the held-out ones only.

An example is two or three digit images followed by text that can only be predicted by
looking at them::

    <bos> <image>xS <image>xS the digits are 3 and 7 ; their sum is 1 0 ; the larger is 7 <eos>
    <bos> (<image>xS)x3 the digits are 3 , 7 and 2 ; their sum is 1 2 ; the largest is 7 <eos>

Numbers are spelled digit by digit by a fixed word-level tokenizer (``tokenizer.json`` in each
run). The *prompt* of an example ends after "the digits are"; its *answer* is the rest.
Training rows pack whole examples into ``seq_len`` positions (padding after the last one that
fits; labels -100 on padding); evaluation runs one example per row, from position 0.

Shape legend: B rows, T positions, N images per row, S patches per image.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from ..errors import UserError

VLM_DATA = "vlm-digits"
N_HELD_OUT = 300  # images held out for evaluation (of 1,797)
SPLIT_SEED = 1234
EVAL_SEED = 4321
SPECIALS = ("<pad>", "<image>", "<bos>", "<eos>", "<unk>")
WORDS = ("the", "digits", "are", "and", ",", ";", "their", "sum", "is", "larger", "largest")
VOCAB = {t: i for i, t in enumerate(SPECIALS + tuple(str(d) for d in range(10)) + WORDS)}
PAD, IMAGE, BOS, EOS = (VOCAB[t] for t in SPECIALS[:4])
SEMI = VOCAB[";"]


def digits_file() -> Path:
    """Path of the digits CSV inside the installed scikit-learn (not imported)."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise UserError(f"--data {VLM_DATA} needs the digit images shipped with scikit-learn: "
                        "pip install -e \".[vlm]\"")
    return path


@dataclass
class Digits:
    images: np.ndarray  # (n, 1, 8, 8) float32 in [0, 1]
    labels: np.ndarray  # (n,) int64
    train_idx: np.ndarray  # indices of training images
    val_idx: np.ndarray  # indices of held-out images
    sha256: str

    def record(self) -> dict:
        return {"source": VLM_DATA, "sha256": self.sha256, "images": len(self.labels),
                "train_images": len(self.train_idx), "held_out_images": len(self.val_idx),
                "split": f"seeded permutation ({SPLIT_SEED}), last {N_HELD_OUT} held out"}


def load_digits() -> Digits:
    raw = digits_file().read_bytes()
    rows = np.loadtxt(gzip.decompress(raw).decode().splitlines(), delimiter=",")  # (n, 65)
    images = (rows[:, :64] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    labels = rows[:, 64].astype(np.int64)
    perm = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    return Digits(images, labels, np.sort(perm[:-N_HELD_OUT]), np.sort(perm[-N_HELD_OUT:]),
                  hashlib.sha256(raw).hexdigest())


def build_tokenizer() -> Tokenizer:
    """The task's fixed word-level tokenizer: words, punctuation and single digits."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    return tok


def words(text: str) -> list[int]:
    """Token ids of task text (numbers digit by digit), as ``build_tokenizer`` encodes it."""
    return [VOCAB[w] for w in re.sub(r"(\d)", r" \1 ", text).split()]


@dataclass
class Example:
    images: list[int]  # dataset indices of the images, in order
    prompt: list[int]  # <bos>, placeholders, "the digits are"
    answer: list[int]  # the rest, <eos> included

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.answer


def make_example(digits: Digits, idx: list[int], n_patches: int) -> Example:
    d = [int(digits.labels[i]) for i in idx]
    listed = " and ".join(map(str, d)) if len(d) == 2 else f"{' , '.join(map(str, d[:-1]))} and {d[-1]}"
    which = "larger" if len(d) == 2 else "largest"
    answer = f"{listed} ; their sum is {sum(d)} ; the {which} is {max(d)}"
    prompt = [BOS] + [IMAGE] * (n_patches * len(idx)) + words("the digits are")
    return Example(list(idx), prompt, words(answer) + [EOS])


def sample_examples(digits: Digits, pool: np.ndarray, n: int, rng: np.random.Generator,
                    n_patches: int) -> list[Example]:
    """n examples of 2 or 3 images drawn from ``pool`` (dataset indices)."""
    return [make_example(digits, rng.choice(pool, size=int(rng.integers(2, 4)), replace=False).tolist(), n_patches)
            for _ in range(n)]


def eval_examples(digits: Digits, n: int, n_patches: int) -> list[Example]:
    """The fixed held-out examples (same for every run and seed): held-out images only."""
    return sample_examples(digits, digits.val_idx, n, np.random.default_rng(EVAL_SEED), n_patches)


@dataclass
class Batch:
    ids: torch.Tensor  # (B, T) long, right-padded with <pad>
    labels: torch.Tensor  # (B, T) long: ids, -100 on padding (the model also drops image positions)
    pixel_values: torch.Tensor  # (B, N, 1, 8, 8), zeros where a row has fewer images
    lengths: torch.Tensor  # (B,) real positions per row


def collate(rows: list[tuple[list[int], list[int]]], digits: Digits, width: int | None = None) -> Batch:
    """(token ids, image indices) per row -> a right-padded Batch of ``width`` positions."""
    T = width or max(len(ids) for ids, _ in rows)
    N = max(1, max(len(im) for _, im in rows))
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    pix = torch.zeros(len(rows), N, *digits.images.shape[1:])
    for r, (seq, im) in enumerate(rows):
        ids[r, :len(seq)] = torch.tensor(seq)
        if im:
            pix[r, :len(im)] = torch.from_numpy(digits.images[im])
    lengths = torch.tensor([len(seq) for seq, _ in rows])
    labels = ids.masked_fill(torch.arange(T)[None] >= lengths[:, None], -100)
    return Batch(ids, labels, pix, lengths)


def training_batch(digits: Digits, seed: int, step: int, batch_size: int, seq_len: int,
                   n_patches: int) -> Batch:
    """Global batch ``step``: rows packed with whole training examples, a pure function of
    (seed, step) so that it never depends on what ran before."""
    rng = np.random.default_rng([seed, step])
    rows = []
    for _ in range(batch_size):
        seq, im = [], []
        while True:
            ex = sample_examples(digits, digits.train_idx, 1, rng, n_patches)[0]
            if len(seq) + len(ex.ids) > seq_len:
                break
            seq, im = seq + ex.ids, im + ex.images
        if not seq:
            raise UserError(f"--seq-len {seq_len} is shorter than one digits example ({len(ex.ids)} positions)")
        rows.append((seq, im))
    return collate(rows, digits, seq_len)
