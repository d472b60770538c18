"""The cross-phase report: every phase's figures side by side, all loss curves on one chart, and per eval
category that category's images across phases, in one self-contained HTML file (images inline).

Read from the stages' outputs only: ``metrics/{mix_phase,train,eval_grid}/<phase>.json``,
``metrics/train_loss/<phase>.csv`` and ``eval/<phase>/strips/<category>.png``. A phase with none of them
yet is listed as missing, so the report can be built mid-run (``sdforge report``). The output is
deterministic (no timestamps; PNGs without software metadata), so rebuilding it over the same inputs
writes the same bytes.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on pods and CI; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

from sdforge.io import loss_curve_path  # noqa: E402

log = logging.getLogger(__name__)

LABEL_W = 90
"""Width of the phase label left of each strip row, px."""

COLUMNS = (
    # (header, source, key, format)
    ("samples", "mix_phase", "samples", "{:,.0f}"),
    ("steps", "train", "steps", "{:,.0f}"),
    ("final loss", "train", "final_loss", "{:.4f}"),
    ("mean loss", "train", "mean_loss", "{:.4f}"),
    ("val loss", "train", "final_val_loss", "{:.4f}"),
    ("train s", "train", "seconds", "{:,.0f}"),
    ("samples/s", "train", "samples_per_s", "{:,.1f}"),
    ("sampler steps", "eval_grid", "sampling_steps", "{:,.0f}"),
    ("UNet calls/img", "eval_grid", "unet_calls_per_image", "{:,.1f}"),
    ("colour seen", "eval_grid", "colour_agreement_seen", "{:.0%}"),
    ("shape seen", "eval_grid", "shape_agreement_seen", "{:.0%}"),
    ("colour held-out", "eval_grid", "colour_agreement_held_out", "{:.0%}"),
    ("shape held-out", "eval_grid", "shape_agreement_held_out", "{:.0%}"),
    ("colour concept", "eval_grid", "colour_agreement_concept", "{:.0%}"),
    ("shape concept", "eval_grid", "shape_agreement_concept", "{:.0%}"),
    ("CLIP score", "eval_grid", "clip_score", "{:.4f}"),
    ("FID", "eval_grid", "fid", "{:.2f}"),
)
"""The metrics table's figure columns; a column no phase has a value for is left out."""


@dataclass
class PhaseResults:
    """What the stages wrote for one phase."""

    name: str
    config: dict
    metrics: dict[str, dict] = field(default_factory=dict)
    """``mix_phase`` / ``train`` / ``eval_grid`` → that stage's metrics JSON (absent when not written yet)."""
    curve: list[tuple[int, float]] = field(default_factory=list)
    """``(step, loss)`` of every optimizer step."""
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    """``(step, val_loss)`` at every validation-loss step (``train.val_loss_every`` and the phase's end)."""
    strips: dict[str, Path] = field(default_factory=dict)
    """Eval category → its strip image."""

    @property
    def missing(self) -> bool:
        """True when no stage of the phase has written anything yet."""
        return not self.metrics and not self.curve

    def value(self, source: str, key: str) -> float | None:
        """A numeric metric of one of the phase's stages, or None."""
        v = self.metrics.get(source, {}).get(key)
        return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def read_phase(name: str, config: dict, metrics_dir: Path, eval_dir: Path, categories: list[str]) -> PhaseResults:
    """Collect one phase's metrics JSONs, loss curve and strips (each optional)."""
    result = PhaseResults(name, config)
    for source in ("mix_phase", "train", "eval_grid"):
        path = metrics_dir / source / f"{name}.json"
        if path.is_file():
            result.metrics[source] = json.loads(path.read_text())
    result.curve = read_curve(loss_curve_path(metrics_dir, name))
    result.val_curve = read_curve(loss_curve_path(metrics_dir, name), "val_loss")
    for category in categories:
        strip = eval_dir / name / "strips" / f"{category}.png"
        if strip.is_file():
            result.strips[category] = strip
    return result


def read_curve(path: Path, column: str = "loss") -> list[tuple[int, float]]:
    """``(step, value)`` rows of a ``step,loss,lr[,val_loss]`` CSV's ``column``, rows without a value skipped;
    [] when the file does not exist."""
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as f:
        return [(int(row["step"]), float(row[column])) for row in csv.DictReader(f) if row.get(column)]


def loss_figure(phases: list[PhaseResults]):
    """Every phase's training loss on one chart, on a shared step axis (each phase starts where the previous
    ended), and below it on the same axis the validation loss where it was measured."""
    with_val = any(p.val_curve for p in phases)
    fig, axes = plt.subplots(2 if with_val else 1, 1, figsize=(10, 6.4 if with_val else 3.6), dpi=100, sharex=True,
                             squeeze=False)  # fmt: skip
    ax, offset = axes[0][0], 0
    for i, phase in enumerate(p for p in phases if p.curve):
        steps = [offset + s for s, _ in phase.curve]
        losses = [loss for _, loss in phase.curve]
        colour = f"C{i % 10}"
        ax.plot(steps, losses, color=colour, alpha=0.25, linewidth=0.8)
        ax.plot(steps, moving_average(losses), color=colour, linewidth=1.6, label=phase.name)
        for a in axes[:, 0]:
            a.axvline(offset, color="grey", linewidth=0.6, linestyle=":")
        if phase.val_curve:
            axes[1][0].plot([offset + s for s, _ in phase.val_curve], [v for _, v in phase.val_curve], "o-",
                            color=colour, markersize=3, linewidth=1.2, label=phase.name)  # fmt: skip
        offset = steps[-1]
    ax.set_ylabel("training loss")
    axes[-1][0].set_xlabel("optimizer step (all phases, in order)")
    if with_val:
        axes[1][0].set_ylabel("validation loss (held-out, EMA)")
    for a in axes[:, 0]:
        a.grid(alpha=0.3)
        if offset:
            a.legend(ncol=min(7, len(phases)), fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def moving_average(values: list[float], window: int | None = None) -> list[float]:
    """Trailing mean over ``window`` values (default: 1/20 of the series, at least 1)."""
    window = window or max(1, len(values) // 20)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def category_strip(category: str, phases: list[PhaseResults]) -> Image.Image | None:
    """The phases' strips of one category stacked top to bottom, each labelled with its phase (and its sampler's
    steps where the eval grid used one setting: a distilled phase's 4-step row under its teacher's)."""
    rows = [(strip_label(p), Image.open(p.strips[category]).convert("RGB")) for p in phases if category in p.strips]
    if not rows:
        return None
    width = LABEL_W + max(img.width for _, img in rows)
    out = Image.new("RGB", (width, sum(img.height for _, img in rows)), "white")
    draw, y = ImageDraw.Draw(out), 0
    for name, img in rows:
        out.paste(img, (LABEL_W, y))
        draw.text((6, y + img.height // 2 - 6 * (name.count("\n") + 1)), name, fill="black")
        draw.line([(0, y), (width, y)], fill=(200, 200, 200))
        y += img.height
    return out


def strip_label(phase: PhaseResults) -> str:
    """``phase7`` or, with the eval grid's ``sampling_steps``, ``phase9`` / ``4 steps`` on two lines."""
    steps = phase.value("eval_grid", "sampling_steps")
    return phase.name if steps is None else f"{phase.name}\n{steps:.0f} steps"


def png_bytes(image) -> bytes:
    """A PIL image or matplotlib figure as PNG bytes, without software/date metadata (deterministic)."""
    buf = io.BytesIO()
    if isinstance(image, Image.Image):
        image.save(buf, format="PNG", optimize=True)
    else:
        image.savefig(buf, format="png", metadata={"Software": None})
        plt.close(image)
    return buf.getvalue()


def _img(data: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'


def table_html(phases: list[PhaseResults]) -> str:
    """The per-phase table: config (data mix, LR, warmup, CFG dropout, γ, init) and every figure column."""
    columns = [c for c in COLUMNS if any(p.value(c[1], c[2]) is not None for p in phases)]
    head = ["phase", "data mix", "init", "peak LR", "warmup", "CFG drop", "Min-SNR γ"] + [c[0] for c in columns]
    rows = []
    for p in phases:
        cfg = p.config
        mix = ", ".join(f"{k} {mix_share(v)}" for k, v in cfg.get("mix", {}).items())
        gamma = cfg.get("min_snr_gamma")
        cells = [p.name, mix, cfg.get("init_from", ""), f"{cfg.get('lr', 0):g}", str(cfg.get("warmup_steps", "")),
                 f"{cfg.get('cfg_dropout', 0):g}", "off" if gamma is None else f"{gamma:g}"]
        for _, source, key, fmt in columns:
            v = p.value(source, key)
            cells.append("–" if v is None else fmt.format(v))
        rows.append(cells if not p.missing else cells[:7] + ["not run yet"] + [""] * (len(columns) - 1))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    header = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f'<table id="phases"><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>'


POSTHOC_PREFIX = "posthoc_ema.val_loss."


def posthoc_html(phases: list[PhaseResults]) -> str:
    """The post-hoc EMA's choice per phase that made one (``train.posthoc_sigma_rels``): every candidate's validation
    loss — ``fixed`` is the fixed-decay EMA — the chosen one in bold; "" when no phase chose."""
    rows = []
    for p in phases:
        train = p.metrics.get("train", {})
        scores = {k.removeprefix(POSTHOC_PREFIX): v for k, v in train.items() if k.startswith(POSTHOC_PREFIX)}
        if not scores:
            continue
        sigma = train.get("posthoc_ema.sigma_rel", 0.0)
        chosen = "fixed" if not sigma else f"{sigma:g}"
        cells = [f"<b>{html.escape(n)}: {v:.5f}</b>" if n == chosen else f"{html.escape(n)}: {v:.5f}"
                 for n, v in scores.items()]  # fmt: skip
        row = [html.escape(p.name), html.escape(chosen), " · ".join(cells)]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>")
    if not rows:
        return ""
    return (
        "<h2>Post-hoc EMA</h2><p>Each EMA length (σ<sub>rel</sub>) rebuilt from the phase's snapshots and the "
        "fixed-decay EMA, scored by the validation loss; the lowest (bold) is the phase's <code>unet_ema/</code> "
        "(<code>train.posthoc_sigma_rels</code>, docs/EVAL.md).</p>"
        '<table id="posthoc"><thead><tr><th>phase</th><th>chosen</th><th>validation loss per candidate</th></tr>'
        f"</thead><tbody>{''.join(rows)}</tbody></table>"
    )


def mix_share(value: int | float) -> str:
    """A mix entry as shown: a fraction as a percentage (``0.6`` → ``60%``), a sample count as a number."""
    return f"{value:,}" if isinstance(value, int) else f"{value:.0%}"


STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: right; }
th { background: #f2f2f2; } td:first-child, td:nth-child(2) { text-align: left; }
.scroll { overflow-x: auto; } img { max-width: none; }
"""


@dataclass
class Report:
    """A built report: the page, the images it shows, and each phase's figures as ``<phase>.<metric>``."""

    page: str
    images: dict[str, bytes]
    """``loss.png`` and ``strips/<category>.png`` (also inline in ``page``)."""
    per_phase: dict[str, float]
    phases: int
    phases_reported: int


def build_report(
    title: str, phase_configs: dict[str, dict], categories: list[str], metrics_dir: Path, eval_dir: Path
) -> Report:
    """Read every phase's outputs (in ``phase_configs`` order) and lay out the report."""
    phases = [read_phase(name, cfg, metrics_dir, eval_dir, categories) for name, cfg in phase_configs.items()]
    images: dict[str, bytes] = {}
    if any(p.curve for p in phases):
        images["loss.png"] = png_bytes(loss_figure(phases))
    strips = {c: strip for c in categories if (strip := category_strip(c, phases)) is not None}
    images.update({f"strips/{c}.png": png_bytes(img) for c, img in strips.items()})
    page = render_html(title, phases, images.get("loss.png"), {c: images[f"strips/{c}.png"] for c in strips})
    per_phase = {
        f"{p.name}.{key}": float(value)
        for p in phases
        for _, source, key, _ in COLUMNS
        if (value := p.value(source, key)) is not None
    }
    return Report(page, images, per_phase, len(phases), sum(not p.missing for p in phases))


PROBE_NOTE = "; colour and shape: the demo probe's agreement with the prompt over seen and held-out combinations"


def render_html(title: str, phases: list[PhaseResults], loss_png: bytes | None, strips: dict[str, bytes]) -> str:
    """The whole report as one HTML page (images as data URIs, no external resource)."""
    probed = any(p.value("eval_grid", "colour_agreement_seen") is not None for p in phases)
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
        "<h2>Phases</h2>",
        f"<p>Each phase starts from the weights of its <i>init</i> (its EMA weights by default). Figures from "
        f"<code>metrics/</code>{PROBE_NOTE if probed else ''}.</p>",
        f'<div class="scroll">{table_html(phases)}</div>',
        "<h2>Training loss</h2>",
        "<p>Below the training loss, where measured: the validation loss of the EMA weights on held-out samples at "
        "fixed noise levels (<code>train.held_out</code>, <code>train.val_loss_every</code>).</p>"
        if any(p.val_curve for p in phases) else "",
        _img(loss_png, "loss curves of all phases") if loss_png else "<p>No loss curve yet.</p>",
        posthoc_html(phases),
    ]
    for category, data in strips.items():
        parts += [f"<h2>Eval: {html.escape(category)}</h2>", f'<div class="scroll">{_img(data, category)}</div>']
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
