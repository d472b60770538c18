"""The demo's captioner: a tiny BLIP built locally from the real architecture's classes (no download), and trained
on demo renders so that it reads a shape's colour, kind and background back as a demo caption.

:func:`build_blip` saves a randomly initialised model (the tests' and ``bench.caption``'s captioner).
:func:`train_demo_captioner` builds one over the demo caption words and trains it with teacher forcing on freshly
rendered *shown* combinations (never a held-out one, never the concept colour), rendered as the pipeline fetches
them: drawn on ``demo.canvases`` in turn, resized (keep ratio, INTER_AREA) to :data:`FETCH_SIDE` on the shorter
side and JPEG-encoded, as ``fetch_images`` stores them; BLIP's processor then squashes every image to its square
``image_size``. :func:`caption_accuracy` scores its captions of fresh renders (held-out combinations apart).

Off-palette renders: a share of each batch (:data:`OFF_PALETTE`) shows a shown combination's shape and background
in a random colour far from every demo colour (the concept's included), its caption's article and colour word left
out of the loss. Without them the model reads the shape partly from the colour and background (the shapes each pair
shows) and names a held-out combination's shape below chance (bench.demo_captioner, seeds 0-2: 0.13-0.38, chance
1/3); with half of each batch off-palette, 0.53-0.57. Shown combinations are read as well either way (0.96-1.0).

Prompt convention: unconditional. The model is trained to write the whole caption after ``[DEC]`` (BLIP's
``generate`` starts from it), so ``generate(processor, model, images, PROMPT, SETTINGS)`` with
:data:`PROMPT` ``""`` returns e.g. ``a red circle on a white background``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch
from transformers import BertTokenizer, BlipConfig, BlipForConditionalGeneration, BlipImageProcessor, BlipProcessor

from sdforge.captions.captioner import generate, load_captioner
from sdforge.config import DemoData
from sdforge.demo.corpus import CanvasCycle, deck, encode_image
from sdforge.demo.shapes import ShapeSpec, SpecDeck, parse_caption, render, shown_specs

log = logging.getLogger(__name__)

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]"]
FETCH_SIDE = 32
"""Shorter side of the demo images as ``fetch_images`` stores them (``sources.*.fetch.image_size``, keep ratio)."""
PROMPT = ""
"""The demo captioner writes the whole caption unprompted (``recaption.prompt: ""``)."""
SETTINGS = {"max_new_tokens": 12, "num_beams": 1}
"""Greedy decoding; a demo caption is 7 words + ``[SEP]`` (8 tokens)."""
WARMUP = 0.1
"""Share of the steps the learning rate ramps up over (linearly), before its cosine decay to 0."""
OFF_PALETTE = 0.5
"""Default share of each training batch drawn in an off-palette colour (:class:`TrainingRenders`)."""
OFF_PALETTE_MARGIN = 90.0
"""Least RGB distance of an off-palette colour from every palette colour and background."""
_TRAIN_STREAM, _EVAL_STREAM = 11, 12  # independent numpy streams under a seed


def build_blip(
    out: Path, words: list[str], width: int = 32, layers: int = 1, image_size: int = 32, seed: int = 0
) -> Path:
    """``BlipForConditionalGeneration`` with vision and text towers of ``width`` and ``layers``, its processor (a BERT
    word-piece tokenizer over ``words``, BLIP's image processor at ``image_size``), saved to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = out / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + list(words)) + "\n")
    tokenizer = BertTokenizer(str(vocab), bos_token="[DEC]")
    heads = max(1, width // 16)
    vision = {"hidden_size": width, "intermediate_size": 2 * width, "num_hidden_layers": layers,
              "num_attention_heads": heads, "image_size": image_size, "patch_size": 8,
              "projection_dim": width}  # fmt: skip
    text = {"vocab_size": len(SPECIAL) + len(words), "hidden_size": width, "intermediate_size": 2 * width,
            "num_hidden_layers": layers, "num_attention_heads": heads, "max_position_embeddings": 64,
            "encoder_hidden_size": width, "pad_token_id": 0, "bos_token_id": SPECIAL.index("[DEC]"),
            "sep_token_id": SPECIAL.index("[SEP]"), "eos_token_id": SPECIAL.index("[SEP]")}  # fmt: skip
    torch.manual_seed(seed)
    model = BlipForConditionalGeneration(BlipConfig(vision_config=vision, text_config=text, projection_dim=width))
    processor = BlipProcessor(
        image_processor=BlipImageProcessor(size={"height": image_size, "width": image_size}), tokenizer=tokenizer
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)
    vocab.unlink()
    return out


def caption_words(demo: DemoData) -> list[str]:
    """Every word of a demo caption over ``demo.colours`` (not the concept colour), in first-seen order."""
    captions = [ShapeSpec(shape=s, colour=c, background=b).caption()
                for c in demo.colours for s in demo.shapes for b in demo.backgrounds]  # fmt: skip
    return list(dict.fromkeys(w for caption in captions for w in caption.split()))


def fetched_render(
    demo: DemoData,
    spec: ShapeSpec,
    canvas: tuple[int, int],
    rng: np.random.Generator,
    side: int = FETCH_SIDE,
    colour_rgb: tuple[int, int, int] | None = None,
) -> np.ndarray:
    """``spec`` drawn as the corpus draws it on ``canvas`` (width, height) — in ``colour_rgb`` when given, else its
    palette colour — then as ``fetch_images`` stores it: resized to ``side`` on the shorter side (keep ratio,
    INTER_AREA) and JPEG-encoded at the corpus' quality; RGB uint8."""
    colour = colour_rgb if colour_rgb is not None else demo.palette[spec.colour]
    img = render(spec, canvas, colour, demo.backgrounds[spec.background], rng, demo.half_size)
    # sdforge.ingest.image_convert.resize's keep_ratio, not imported: importing it imports every source kind
    # (sdforge.ingest.sources), all of which would become prepare_models deps; a test checks the bytes agree
    scale = side / min(canvas)
    size = max(1, round(canvas[0] * scale)), max(1, round(canvas[1] * scale))
    if size != tuple(canvas):
        img = cv2.resize(img, size, interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LANCZOS4)
    bgr = cv2.imdecode(np.frombuffer(encode_image(img, ".jpg"), np.uint8), cv2.IMREAD_COLOR)
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def render_batch(
    demo: DemoData, specs: SpecDeck, canvases: CanvasCycle, rng: np.random.Generator, n: int, side: int = FETCH_SIDE
) -> tuple[list[np.ndarray], list[ShapeSpec]]:
    """The deck's next ``n`` specs, each on the next canvas, as :func:`fetched_render` draws them."""
    drawn = [specs.draw() for _ in range(n)]
    return [fetched_render(demo, spec, canvases.next(), rng, side) for spec in drawn], drawn


def off_palette_colour(demo: DemoData, rng: np.random.Generator) -> tuple[int, int, int]:
    """A uniform RGB colour at least :data:`OFF_PALETTE_MARGIN` from every palette colour (the concept's included)
    and every background: a shape colour no demo caption names."""
    named = np.array([*demo.palette.values(), *demo.backgrounds.values()], np.float64)
    while True:
        rgb = rng.integers(0, 256, 3)
        if np.sqrt(((named - rgb) ** 2).sum(1)).min() >= OFF_PALETTE_MARGIN:
            return int(rgb[0]), int(rgb[1]), int(rgb[2])


@dataclass
class TrainingBatch:
    """One step's renders: ``captions[i]`` is ``specs[i].caption()``; where ``colour_known[i]`` is false the
    image's shape is drawn in ``colours[i]`` (:func:`off_palette_colour`) and the caption's article and colour are
    stand-ins, left out of the loss."""

    images: list[np.ndarray]
    specs: list[ShapeSpec]
    colours: list[tuple[int, int, int]]
    colour_known: list[bool]

    @property
    def captions(self) -> list[str]:
        """The teacher-forced captions."""
        return [s.caption() for s in self.specs]


class TrainingRenders:
    """The captioner's training stream for ``seed``: fresh renders of shown combinations only (balanced rounds, the
    canvases in turn, never a held-out combination, never the concept colour), a share ``off_palette`` of each batch
    drawn in an off-palette colour instead (shape and background still scored: they teach shape reading that does
    not lean on the colour)."""

    def __init__(self, demo: DemoData, seed: int, off_palette: float = OFF_PALETTE, side: int = FETCH_SIDE):
        self.demo, self.off_palette, self.side = demo, off_palette, side
        self.rng = np.random.default_rng([seed, _TRAIN_STREAM])
        self.specs, self.stand_ins, self.canvases = deck(demo, self.rng), deck(demo, self.rng), CanvasCycle(demo)

    def batch(self, n: int) -> TrainingBatch:
        """The next ``n`` renders (the last ``round(n * off_palette)`` off-palette)."""
        plain = n - round(n * self.off_palette)
        images, specs = render_batch(self.demo, self.specs, self.canvases, self.rng, plain, self.side)
        colours = [self.demo.palette[s.colour] for s in specs]
        for _ in range(n - plain):
            spec, rgb = self.stand_ins.draw(), off_palette_colour(self.demo, self.rng)
            images.append(fetched_render(self.demo, spec, self.canvases.next(), self.rng, self.side, rgb))
            specs.append(spec)
            colours.append(rgb)
        return TrainingBatch(images, specs, colours, [i < plain for i in range(n)])


def teacher_batch(processor, batch: TrainingBatch) -> dict[str, torch.Tensor]:
    """``pixel_values``, ``input_ids`` (first token ``[DEC]``, as BLIP's ``generate`` starts) and ``labels``
    (padding ignored; in off-palette rows, the article and the stand-in colour too) for one teacher-forced step."""
    pixels = processor(images=batch.images, return_tensors="pt")["pixel_values"]
    text = processor.tokenizer(batch.captions, return_tensors="pt", padding=True)
    input_ids = text["input_ids"].clone()
    input_ids[:, 0] = processor.tokenizer.bos_token_id
    labels = input_ids.masked_fill(text["attention_mask"] == 0, -100)
    for row, (spec, known) in enumerate(zip(batch.specs, batch.colour_known, strict=True)):
        if not known:
            colour_at = int((input_ids[row] == processor.tokenizer.convert_tokens_to_ids(spec.colour)).nonzero()[0])
            labels[row, : colour_at + 1] = -100
    return {"pixel_values": pixels, "input_ids": input_ids, "attention_mask": text["attention_mask"], "labels": labels}


def _schedule(steps: int):
    """Linear warm-up over :data:`WARMUP` of ``steps``, then cosine decay to 0 (a ``LambdaLR`` factor)."""
    warm = max(1, int(steps * WARMUP))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))

    return factor


def fit(model, processor, renders: TrainingRenders, steps: int, batch_size: int, lr: float) -> list[float]:
    """``steps`` AdamW steps (weight decay 0.01, gradients clipped at 1, :func:`_schedule`) of teacher forcing on
    ``renders``; the loss of each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(steps))
    losses: list[float] = []
    model.train()
    for step in range(steps):
        loss = model(**teacher_batch(processor, renders.batch(batch_size))).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            log.info("captioner step %d/%d: loss %.4f", step + 1, steps, losses[-1])
    return losses


def train_demo_captioner(
    out: Path,
    demo: DemoData,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    width: int,
    layers: int,
    image_size: int,
    seed: int,
    off_palette: float = OFF_PALETTE,
) -> dict:
    """Build a BLIP over :func:`caption_words` (:func:`build_blip`, seeded with ``seed``), train it ``steps`` steps
    of ``batch_size`` fresh renders (:class:`TrainingRenders`, :func:`fit`) and save model + processor to ``out``
    (``load_captioner(out)`` loads them; caption with :data:`PROMPT` and :data:`SETTINGS`). Deterministic for
    ``seed``: the same weights run to run on one machine and thread count.

    Returns ``{loss_first, loss_final (mean of the last tenth of the steps), steps, seconds, cpu_seconds, params,
    words, off_palette}``; ``seconds`` / ``cpu_seconds``: the loop's wall / process CPU time."""
    build_blip(out, caption_words(demo), width=width, layers=layers, image_size=image_size, seed=seed)
    processor, model = load_captioner(str(out))  # the classes and preprocessing captioning will load
    t0, c0 = time.perf_counter(), time.process_time()
    losses = fit(model, processor, TrainingRenders(demo, seed, off_palette), steps, batch_size, lr)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    model.eval().save_pretrained(out)
    processor.save_pretrained(out)
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "loss_first": losses[0] if losses else None,
        "loss_final": float(np.mean(tail)) if losses else None,
        "steps": steps,
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu_seconds, 2),
        "params": sum(p.numel() for p in model.parameters()),
        "words": len(processor.tokenizer) - len(SPECIAL),
        "off_palette": off_palette,
    }


def eval_renders(demo: DemoData, n: int, seed: int, side: int = FETCH_SIDE) -> tuple[list[np.ndarray], list[ShapeSpec]]:
    """``n`` fresh renders for scoring, from a numpy stream training never draws from: every combination of
    ``demo.colours`` (held-out ones included) in balanced rounds, the canvases in turn."""
    rng = np.random.default_rng([seed, _EVAL_STREAM])
    every = SpecDeck(shown_specs(list(demo.colours), list(demo.shapes), list(demo.backgrounds), []), rng)
    return render_batch(demo, every, CanvasCycle(demo), rng, n, side)


def parsed(text: str) -> ShapeSpec | None:
    """``text`` as a demo caption's spec, or None when it is not of the demo form."""
    try:
        return parse_caption(text)
    except ValueError:
        return None


def score_captions(demo: DemoData, specs: list[ShapeSpec], generated: list[str]) -> dict:
    """Colour / shape / background accuracy of ``generated`` against ``specs``, the shown and the held-out
    combinations apart; a caption that is not of the demo form (:func:`parse_caption`) counts wrong throughout."""
    reads = [parsed(t) for t in generated]
    hidden = [demo.is_held_out(s.colour, s.shape, s.background) for s in specs]

    def accuracy(field: str, held_out: bool) -> float | None:
        hits = [r is not None and getattr(r, field) == getattr(s, field)
                for r, s, h in zip(reads, specs, hidden, strict=True) if h == held_out]  # fmt: skip
        return float(np.mean(hits)) if hits else None

    return {
        "colour_accuracy": accuracy("colour", False),
        "shape_accuracy": accuracy("shape", False),
        "background_accuracy": accuracy("background", False),
        "held_out_colour_accuracy": accuracy("colour", True),
        "held_out_shape_accuracy": accuracy("shape", True),
        "held_out_background_accuracy": accuracy("background", True),
        "well_formed": float(np.mean([r is not None for r in reads])) if reads else None,
        "exact": float(np.mean([r == s for r, s in zip(reads, specs, strict=True)])) if reads else None,
        "n": len(specs),
        "n_held_out": int(sum(hidden)),
    }


def caption_accuracy(
    model_dir: Path, demo: DemoData, *, n: int, seed: int, prompt: str = PROMPT, batch_size: int = 64
) -> dict:
    """Caption ``n`` fresh renders (:func:`eval_renders`) with the captioner in ``model_dir`` (``load_captioner`` +
    ``generate``, :data:`SETTINGS`) and score them (:func:`score_captions`): ``colour_accuracy``, ``shape_accuracy``,
    ``background_accuracy`` over the shown combinations, ``held_out_*`` over the held-out ones, ``well_formed``,
    ``exact`` (every field right, all images), ``n``, ``n_held_out`` and ``examples``: the first 8 (truth, text)."""
    processor, model = load_captioner(str(model_dir))
    images, specs = eval_renders(demo, n, seed)
    generated: list[str] = []
    for start in range(0, n, batch_size):
        generated += generate(processor, model, images[start : start + batch_size], prompt, SETTINGS)
    scores = score_captions(demo, specs, generated)
    scores["examples"] = [(s.caption(), g) for s, g in zip(specs[:8], generated[:8], strict=True)]
    return scores
