"""Synthetic captions' pure parts: content keys and the recaption plan, degenerate generations, the per-epoch mix."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdforge.captions.cache import caption_key, plan_captions, settings_fingerprint
from sdforge.captions.mix import realised_share, sample_ids, synthetic_mask
from sdforge.captions.quality import EMPTY, PROMPT_ECHO, REPETITION, TOO_LONG, judge

SETTINGS = ("Salesforce/blip-image-captioning-base", "82a37760", "a photo of", {"max_new_tokens": 40, "num_beams": 3})


def test_every_setting_changes_the_fingerprint_and_the_key():
    base = settings_fingerprint(*SETTINGS)
    changed = [
        settings_fingerprint("other/model", *SETTINGS[1:]),
        settings_fingerprint(SETTINGS[0], "ffffffff", *SETTINGS[2:]),
        settings_fingerprint(*SETTINGS[:2], "describe the image", SETTINGS[3]),
        settings_fingerprint(*SETTINGS[:3], {"max_new_tokens": 40, "num_beams": 4}),
    ]
    assert len({base, *changed}) == 5
    assert settings_fingerprint(*SETTINGS[:3], {"num_beams": 3, "max_new_tokens": 40}) == base  # order-free
    assert caption_key("ab" * 32, base) != caption_key("cd" * 32, base) != caption_key("cd" * 32, changed[0])


def test_adding_images_captions_only_the_new_ones_and_a_prompt_change_recaptions_all():
    fp = settings_fingerprint(*SETTINGS)
    done = {f"img{i}": fp for i in range(8)}
    plan = plan_captions([f"img{i}" for i in range(10)] + ["img9"], done, fp)
    assert plan.todo == ["img8", "img9"] and plan.cached == 8 and plan.stale == 0
    new_prompt = settings_fingerprint(*SETTINGS[:2], "describe the image", SETTINGS[3])
    plan = plan_captions([f"img{i}" for i in range(10)], done, new_prompt)
    assert len(plan.todo) == 10 and plan.cached == 0 and plan.stale == 8


@pytest.mark.parametrize(
    ("caption", "tokens", "reason"),
    [
        ("", 2, EMPTY),
        ("  ... ", 2, EMPTY),
        ("a photo of a red circle", 8, PROMPT_ECHO),
        ("a red circle a red circle a red circle a red circle on white", 16, REPETITION),
        ("circle circle circle circle circle red", 8, REPETITION),
        ("a red circle beside " + " ".join(f"detail{i}" for i in range(85)), 90, TOO_LONG),
        ("a red circle on a white background", 9, None),
        ("a green square and a red circle on a black background", 13, None),
    ],
)
def test_degenerate_generations_are_named(caption, tokens, reason):
    assert judge(caption, "a photo of", tokens) == reason


def _ids(n: int = 4000) -> np.ndarray:
    """Samples of two sources over 4 shards and 2 buckets."""
    i = np.arange(n)
    return sample_ids(["laion", "web"], i % 2, i % 4, np.where(i % 3, 32, 24), np.where(i % 3, 32, 40), i // 2)


def test_samples_get_distinct_ids():
    assert len(np.unique(_ids())) == 4000


def test_the_caption_choice_is_a_function_of_seed_sample_and_epoch():
    ids = _ids()
    first = synthetic_mask(0, 3, ids, 0.5)
    assert (first == synthetic_mask(0, 3, ids.copy(), 0.5)).all()  # resume / any rank: the same choice
    assert (first[::-1] == synthetic_mask(0, 3, ids[::-1], 0.5)).all()  # order in the index does not matter
    assert (first != synthetic_mask(0, 4, ids, 0.5)).any()  # another epoch: another draw
    assert (first != synthetic_mask(1, 3, ids, 0.5)).any()  # another seed: another draw
    assert not synthetic_mask(0, 3, ids, 0.0).any() and synthetic_mask(0, 3, ids, 1.0).all()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_the_realised_share_is_the_planned_one_within_sampling_error(p):
    ids = _ids()
    for epoch in range(3):
        share = realised_share(7, ids, epoch, p)
        assert abs(share - p) <= 4 * math.sqrt(p * (1 - p) / len(ids)), (epoch, share)
