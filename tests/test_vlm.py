"""Vision-language ConceptMoE (issue 13): images in the sequence, cached decode, the digits task."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conceptmoe import ModelConfig, build_model, count_flops
from conceptmoe.inference.steps import decode_step, prefill
from conceptmoe.model.vision import embed_inputs, patchify

IMG = 1  # image placeholder id


def cfg_vlm(kind="conceptmoe", **over):
    return ModelConfig.from_preset("tiny", **{"kind": kind, "image_size": 8, "patch_size": 4,
                                              "image_token_id": IMG, **over})


def model_of(cfg, seed=0):
    torch.manual_seed(seed)
    m = build_model(cfg).eval()
    for name, p in m.named_parameters():  # random, independent weights: no identity/zero inits
        if "chunk." in name or ".attn.j" in name:
            torch.nn.init.normal_(p, std=0.3)
    return m


def seq(*parts):
    """ids from parts: an int n = one image (n_patches=4 placeholders), a list = text ids."""
    out = []
    for p in parts:
        out += [IMG] * 4 if p == "img" else list(p)
    return torch.tensor(out)


KINDS = ["moe", "conceptmoe"]


def test_patchify_row_major():
    x = torch.arange(64.0).view(1, 1, 8, 8)
    p = patchify(x, 4)  # (1, 4, 16)
    assert p.shape == (1, 4, 16)
    assert p[0, 1, 0] == 4 and p[0, 2, 0] == 32  # patch 1 starts at column 4, patch 2 at row 4


@pytest.mark.parametrize("kind", KINDS)
def test_causal_across_image_and_text(kind):
    m = model_of(cfg_vlm(kind))
    ids = seq([5, 6], "img", [7, 8, 9], "img", [10, 11])[None]
    pix = torch.rand(1, 2, 1, 8, 8)
    base = m(ids, pixel_values=pix).logits
    second_image = 2 + 4 + 3  # position of the second image's first patch
    pix2 = pix.clone()
    pix2[0, 1] = torch.rand(1, 8, 8)
    out = m(ids, pixel_values=pix2).logits
    torch.testing.assert_close(out[:, :second_image], base[:, :second_image])
    assert not torch.allclose(out[:, second_image:], base[:, second_image:])
    ids2 = ids.clone()
    ids2[0, 6] = 30  # a text token between the images
    out = m(ids2, pixel_values=pix).logits
    torch.testing.assert_close(out[:, :6], base[:, :6])
    assert not torch.allclose(out[:, 6:], base[:, 6:])


@pytest.mark.parametrize("kind", KINDS)
def test_batch_invariance_different_image_counts(kind):
    m = model_of(cfg_vlm(kind), seed=1)
    a = seq([5], "img", [7, 8])  # one image
    b = seq([5], "img", [9], "img", "img", [10, 11, 12])  # three images
    pa, pb = torch.rand(1, 1, 8, 8), torch.rand(3, 1, 8, 8)
    solo_a = m(a[None], pixel_values=pa[None]).logits[0]
    solo_b = m(b[None], pixel_values=pb[None]).logits[0]
    ids = torch.zeros(2, len(b), dtype=torch.long)
    ids[0, :len(a)], ids[1] = a, b
    pix = torch.rand(2, 3, 1, 8, 8)  # row 0's images 1 and 2 are unused noise
    pix[0, 0], pix[1] = pa, pb
    out = m(ids, pixel_values=pix).logits
    torch.testing.assert_close(out[0, :len(a)], solo_a, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[1], solo_b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_decode_equals_forward_with_images(kind):
    m = model_of(cfg_vlm(kind), seed=2)
    full = torch.stack([seq([5], "img", [7], "img", [8, 9, 10, 11, 12, 13, 14]),
                        seq([6], "img", "img", [20, 21, 22, 23, 24, 25, 26, 27])])
    pix = torch.rand(2, 2, 1, 8, 8)
    ref = m(full, pixel_values=pix).logits  # (B, T, V)
    P = 11  # prompt: both images and a few text tokens
    out, state = prefill(m, full[:, :P], extra_capacity=full.shape[1], pixel_values=pix)
    torch.testing.assert_close(out.logits, ref[:, P - 1], atol=1e-4, rtol=1e-4)
    for t in range(P, full.shape[1]):
        out = decode_step(m, state, full[:, t])
        torch.testing.assert_close(out.logits, ref[:, t], atol=1e-4, rtol=1e-4)
    cached = m.generate(full[:, :P], 5, temperature=0, pixel_values=pix)
    plain = m.generate(full[:, :P], 5, temperature=0, pixel_values=pix, use_cache=False)
    assert torch.equal(cached, plain)


def test_text_only_prefill_unchanged():
    m = model_of(ModelConfig.from_preset("tiny"))
    ids = torch.randint(0, 256, (2, 9))
    assert torch.equal(embed_inputs(m, ids), m.embed(ids))
    out, _ = prefill(m, ids)
    torch.testing.assert_close(out.logits, m(ids).logits[:, -1])


@pytest.mark.parametrize("kind", KINDS)
def test_patch_positions_have_no_lm_loss(kind):
    m = model_of(cfg_vlm(kind), seed=3)
    ids = seq([5, 6], "img", [7, 8, 9], "img", [10])[None]
    pix = torch.rand(1, 2, 1, 8, 8)
    out = m(ids, labels=ids, pixel_values=pix)
    logits, target = out.logits[0, :-1], ids[0, 1:]
    text = target != IMG
    want = F.cross_entropy(logits[text], target[text])
    torch.testing.assert_close(out.aux["ce_loss"], want)
    assert not torch.allclose(want, F.cross_entropy(logits, target))  # the mask matters


def test_per_modality_compression_and_ratio_target():
    cfg = cfg_vlm()
    m = model_of(cfg, seed=4)
    ids = seq([5, 6], "img", [7, 8, 9], "img", [10])[None]
    pix = torch.rand(1, 2, 1, 8, 8)
    out = m(ids, labels=ids, pixel_values=pix)
    b, img = out.boundaries[0], ids[0] == IMG
    assert out.aux["compression_image"] == pytest.approx(8 / int(b[img].sum()))
    assert out.aux["compression_text"] == pytest.approx(6 / int(b[~img].sum()))
    m2 = model_of(cfg.replace(image_compression_ratio=4.0), seed=4)
    out2 = m2(ids, labels=ids, pixel_values=pix)
    assert not torch.allclose(out2.aux["ratio_loss"], out.aux["ratio_loss"])
    out2.loss.backward()
    assert m2.chunk.wq.weight.grad.abs().sum() > 0


def test_flops_count_the_patch_embedding():
    for kind in KINDS:
        cfg = cfg_vlm(kind)
        assert count_flops(cfg)["total_params"] == build_model(cfg).num_params()
        text = count_flops(cfg.replace(image_size=0))
        assert count_flops(cfg)["activated_flops_per_token"] == text["activated_flops_per_token"] + 2 * 16 * 32


def test_bad_image_inputs():
    m = model_of(cfg_vlm())
    with pytest.raises(ValueError, match="runs of 4"):
        m(torch.tensor([[5, IMG, IMG, 6]]), pixel_values=torch.rand(1, 1, 1, 8, 8))
    with pytest.raises(ValueError, match="image_token_id"):
        cfg_vlm(image_token_id=999)
    with pytest.raises(ValueError, match="text-only"):
        model_of(ModelConfig.from_preset("tiny"))(torch.tensor([[1, 2]]), pixel_values=torch.rand(1, 1, 1, 8, 8))


# ----- the digits task -----

def test_digits_task_held_out_images_never_in_training():
    from conceptmoe.data.digits import (EOS, IMAGE, eval_examples, load_digits, make_example,
                                              training_batch, words)

    d = load_digits()
    assert len(d.labels) == 1797 and not set(d.train_idx) & set(d.val_idx)
    train_imgs = d.images[d.train_idx].reshape(len(d.train_idx), -1)
    val_only = [i for i in d.val_idx  # held-out images with no exact duplicate among training images
                if not (train_imgs == d.images[i].reshape(-1)).all(1).any()]
    assert len(val_only) > 250
    val_set = {d.images[i].tobytes() for i in val_only}
    for step in range(3):
        b = training_batch(d, seed=0, step=step, batch_size=4, seq_len=256, n_patches=16)
        n_img = (b.ids == IMAGE).sum(1) // 16
        for r in range(4):
            for k in range(int(n_img[r])):
                assert b.pixel_values[r, k].numpy().tobytes() not in val_set
    for ex in eval_examples(d, 50, 16):
        assert set(ex.images) <= set(d.val_idx.tolist())
    ex = make_example(d, [0, 1], 16)  # labels 0 and 1
    assert ex.answer == words("0 and 1 ; their sum is 1 ; the larger is 1") + [EOS]


@pytest.mark.slow
def test_train_vlm_digits_end_to_end(tmp_path):
    from conceptmoe.training.config import TrainConfig
    from conceptmoe.training.train import train
    from conceptmoe.evaluation.boundaries import find_vlm_boundaries, render_vlm_html, render_vlm_terminal

    over = {"d_model": 32, "n_experts": 4, "expert_hidden": 16, "n_layers": 3}
    tc = TrainConfig(data="vlm-digits", preset="vlm", overrides=over, max_steps=2, batch_size=2, seq_len=128,
                     out=str(tmp_path / "run"), device="cpu", progress=False)
    out = train(tc)
    import json

    ev = json.loads((out / "eval.json").read_text())
    assert {"val_loss", "answer_accuracy", "compression_image", "compression_text"} <= set(ev)
    assert np.isfinite(ev["val_loss"])
    views = find_vlm_boundaries(out, 2, "cpu")
    assert len(views) == 2 and len(views[0].patch_concepts[0]) == 4  # 4x4 patches of 8x8
    assert "<svg" in render_vlm_html(views, str(out)) and "example 0" in render_vlm_terminal(views)


def test_vlm_run_resumes_exactly_in_the_ordinary_loop(tmp_path, monkeypatch):
    """The digits task trains in the ordinary loop: a SIGTERM checkpoints, --resume equals an
    uninterrupted run."""
    import os
    import signal

    from conceptmoe.errors import Interrupted
    from conceptmoe.training import checkpoint as ck
    from conceptmoe.training import digits as vlm_train
    from conceptmoe.training.config import TrainConfig
    from conceptmoe.training.train import train

    over = {"d_model": 32, "n_experts": 4, "expert_hidden": 16, "n_layers": 3}
    common = dict(data="vlm-digits", preset="vlm", overrides=over, batch_size=2, seq_len=128, device="cpu",
                  progress=False, save_every=4, eval_every=2, max_steps=6)
    ref = train(TrainConfig(**common, out=str(tmp_path / "ref")))
    real_next = vlm_train.DigitsSampler.next

    def next_then_term(self):  # a scheduler's SIGTERM arrives during step 3
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_next(self)

    monkeypatch.setattr(vlm_train.DigitsSampler, "next", next_then_term)
    with pytest.raises(Interrupted):
        train(TrainConfig(**common, out=str(tmp_path / "run")))
    assert [r["step"] for r in ck.read_metrics(tmp_path / "run")] == [1, 2, 3]
    monkeypatch.setattr(vlm_train.DigitsSampler, "next", real_next)
    out = train(TrainConfig(**common, out=str(tmp_path / "run"), resume=True))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]  # noqa: E731
    assert strip(ck.read_metrics(out)) == strip(ck.read_metrics(ref))
    assert (out / "eval.json").read_text() == (ref / "eval.json").read_text()


def test_digits_sampler_position_round_trip():
    from conceptmoe.data.digits import load_digits
    from conceptmoe.training.digits import DigitsSampler

    digits = load_digits()
    a = DigitsSampler(digits, 3, 2, 128, 4)
    first = [a.next() for _ in range(3)]
    b = DigitsSampler(digits, 3, 2, 128, 4)
    b.set_position({"step": 2})
    assert a.position == {"step": 3}
    again = b.next()
    for k in ("input_ids", "labels", "pixel_values"):
        assert torch.equal(again[k], first[2][k])
