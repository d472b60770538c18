"""Synthetic captions' pure parts: content keys and the recaption plan, degenerate generations, the per-epoch mix."""

from __future__ import annotations

import math

import pytest

from sdforge.captions.cache import caption_key, plan_captions, settings_fingerprint
from sdforge.captions.mix import realised_share, uses_synthetic
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


def test_the_caption_choice_is_a_function_of_seed_key_and_epoch():
    keys = [f"{i:06d}" for i in range(4000)]
    first = [uses_synthetic(0, k, 3, 0.5) for k in keys]
    assert first == [uses_synthetic(0, k, 3, 0.5) for k in keys]  # resume / any rank: the same choice
    assert first != [uses_synthetic(0, k, 4, 0.5) for k in keys]  # another epoch: another draw
    assert first != [uses_synthetic(1, k, 3, 0.5) for k in keys]  # another seed: another draw
    assert not any(uses_synthetic(0, k, 3, 0.0) for k in keys) and all(uses_synthetic(0, k, 3, 1.0) for k in keys)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_the_realised_share_is_the_planned_one_within_sampling_error(p):
    keys = [f"{i:06d}" for i in range(4000)]
    for epoch in range(3):
        share = realised_share(7, keys, epoch, p)
        assert abs(share - p) <= 4 * math.sqrt(p * (1 - p) / len(keys)), (epoch, share)
