"""The captioner's real code path — ``from_pretrained`` of a local folder, batched ``generate``, the judge — on a
tiny BLIP built from the real architecture's classes (random weights: its text is noise, often degenerate)."""

from __future__ import annotations

import numpy as np
import pytest

from sdforge.captions.captioner import generate, judge_captions, load_captioner, strip_prompt
from sdforge.captions.quality import REASONS, REPETITION
from tests.fixtures.captioner import build_tiny_blip


@pytest.fixture(scope="module")
def blip(tmp_path_factory):
    return load_captioner(str(build_tiny_blip(tmp_path_factory.mktemp("blip"))))


def _images(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (40, 48, 3), dtype=np.uint8) for _ in range(n)]


def test_generation_is_per_image_deterministic_and_independent_of_the_batch(blip):
    processor, model = blip
    settings = {"max_new_tokens": 8, "num_beams": 1}
    images = _images(4)
    together = generate(processor, model, images, "a photo of", settings)
    assert len(together) == 4 and all(isinstance(t, str) for t in together)
    assert together == generate(processor, model, images, "a photo of", settings)
    assert together[2:] == generate(processor, model, images[2:], "a photo of", settings)
    with pytest.raises(ValueError, match="do_sample"):
        generate(processor, model, images, "a photo of", {"do_sample": True})


def test_rejected_generations_keep_the_original_and_say_why():
    generated = ["", "a red circle a red circle a red circle a red circle", "a photo of", "a blue square on white"]
    originals = ["img_0001.jpg", "img_0002.jpg", "img_0003.jpg", "img_0004.jpg"]
    out = judge_captions(generated, originals, "a photo of", count_tokens=lambda t: len(t.split()) + 2)
    assert [c.text for c in out] == ["img_0001.jpg", "img_0002.jpg", "img_0003.jpg", "a blue square on white"]
    assert [c.rejected for c in out] == ["empty", REPETITION, "prompt_echo", None]


def test_the_tiny_models_output_is_judged_whatever_it_is(blip):
    processor, model = blip
    generated = generate(processor, model, _images(3), "a photo of", {"max_new_tokens": 12})
    originals = ["o1", "o2", "o3"]
    out = judge_captions(generated, originals, "a photo of", count_tokens=lambda t: len(t.split()) + 2)
    for caption, text, original in zip(out, generated, originals, strict=True):
        assert caption.generated == text and caption.rejected in (None, *REASONS)
        assert caption.text == (original if caption.rejected else text)


def test_the_prompt_a_model_continues_is_cut_off():
    assert strip_prompt("A photo of a red circle", "a photo of") == "a red circle"
    assert strip_prompt("a photo of, a red circle", "a photo of") == "a red circle"
    assert strip_prompt("a red circle", "a photo of") == "a red circle"
