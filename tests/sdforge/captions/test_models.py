"""What a ``recaption`` section names and keys on, the vLLM backend's absence, and the shortening pass on a tiny
GPT-2 built locally (random weights: its text is meaningless, its mechanics are real)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import BertTokenizer, GPT2Config, GPT2LMHeadModel

from sdforge.captions.models import (
    BUILT_CAPTIONER,
    captioner_for,
    recaption_fingerprint,
    resolve_model,
    with_shortening,
)
from sdforge.config import Recaption, Shorten
from sdforge.io import InputError
from tests.fixtures.captioner import WORDS, build_tiny_blip

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _tiny_gpt2(folder) -> str:
    folder.mkdir(parents=True)
    (folder / "vocab.txt").write_text("\n".join(SPECIAL + WORDS + ["rewrite", "short", "description"]) + "\n")
    tokenizer = BertTokenizer(str(folder / "vocab.txt"))
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1, n_head=2,
                        eos_token_id=tokenizer.sep_token_id, bos_token_id=tokenizer.cls_token_id)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(folder)
    return str(folder)


def test_a_built_captioner_must_exist_and_a_local_one_is_keyed_on_its_files(tmp_path):
    with pytest.raises(InputError, match="models.captioner_build"):
        resolve_model("build", None, tmp_path)
    build_tiny_blip(tmp_path / BUILT_CAPTIONER)
    path, revision = resolve_model("build", None, tmp_path)
    assert path == str(tmp_path / BUILT_CAPTIONER) and revision.startswith("sha256:")
    assert resolve_model(path, None, tmp_path) == (path, revision)  # the same folder named directly
    build_tiny_blip(tmp_path / BUILT_CAPTIONER, seed=1)
    assert resolve_model("build", None, tmp_path)[1] != revision
    assert resolve_model("org/model", "abc123", tmp_path) == ("org/model", "abc123")  # a hub id: its revision


def test_every_caption_shaping_setting_changes_the_fingerprint():
    rec = Recaption(model="m", prompt="a photo of")
    base = recaption_fingerprint(rec, "m", "r1", None)
    variants = [
        recaption_fingerprint(rec.model_copy(update={"prompt": "describe"}), "m", "r1", None),
        recaption_fingerprint(rec.model_copy(update={"dtype": "bf16"}), "m", "r1", None),
        recaption_fingerprint(rec.model_copy(update={"max_tokens": 40}), "m", "r1", None),
        recaption_fingerprint(rec.model_copy(update={"generation": {"max_new_tokens": 9}}), "m", "r1", None),
        recaption_fingerprint(rec.model_copy(update={"shorten": Shorten(model="t")}), "m", "r1", "s1"),
        recaption_fingerprint(rec, "m", "r2", None),
    ]
    assert len({base, *variants}) == 7
    assert recaption_fingerprint(rec.model_copy(update={"batch_size": 64, "device": "cuda"}), "m", "r1", None) == base


def test_sampling_is_refused_at_load():
    with pytest.raises(ValueError, match="do_sample"):
        Recaption(model="m", generation={"do_sample": True})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_the_vllm_backend_without_vllm_is_a_clear_error():
    with pytest.raises(InputError, match="pip install vllm"):
        captioner_for(Recaption(model="m", backend="vllm"), "m", None)


def test_the_shortening_pass_rewrites_each_caption_deterministically(tmp_path):
    shorten = Shorten(model=_tiny_gpt2(tmp_path / "gpt2"), prompt="rewrite {caption} short description",
                      generation={"max_new_tokens": 4, "num_beams": 1})  # fmt: skip
    first = ["a red circle on a white background", "", "a blue square on a black background"]
    run = with_shortening(lambda images: list(first), shorten, "cpu")
    out = run([None] * 3)
    assert out[1] == ""  # an empty caption stays empty (the judge rejects it)
    assert out[0] != first[0] and out[2] != first[2]  # rewritten by the text model, its prompt not included
    assert all(len(text.split()) <= 4 for text in out)  # at most max_new_tokens word pieces
    assert not out[0].startswith("rewrite a red circle")  # only the continuation is kept
    assert run([None] * 3) == out  # greedy: the same text every time
