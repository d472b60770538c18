"""CLIP's real 49,408-token BPE tokenizer, built offline from the merges file that ``open-clip-torch`` ships.

The vocabulary is laid out exactly as OpenAI CLIP's ``SimpleTokenizer`` builds it (and as
``openai/clip-vit-large-patch14``'s ``vocab.json`` holds it): the 256 byte characters, their ``</w>``
forms, one token per merge, then ``<|startoftext|>`` (49406) and ``<|endoftext|>`` (49407).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
from pathlib import Path

from transformers import CLIPTokenizer

from model.builders import BOS_TOKEN, END_OF_WORD, EOS_TOKEN, _bytes_to_unicode
from sdforge.config import ConfigError

log = logging.getLogger(__name__)

OPEN_CLIP_PIN = "open-clip-torch==3.3.0"
BPE_FILE = "bpe_simple_vocab_16e6.txt.gz"
N_MERGES = 49152 - 256 - 2
"""CLIP keeps the first 48,894 merges (SimpleTokenizer: ``merges[1 : 49152 - 256 - 2 + 1]``)."""
VOCAB_SIZE = 2 * 256 + N_MERGES + 2


def clip_bpe_path() -> Path:
    """``open_clip/bpe_simple_vocab_16e6.txt.gz``, found without importing ``open_clip`` (which imports
    torchvision, never installed here); :class:`ConfigError` with the install command if it is missing."""
    spec = importlib.util.find_spec("open_clip")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(folders[0]) / BPE_FILE if folders else None
    if path is None or not path.is_file():
        raise ConfigError(
            f"models.missing_weights: random builds CLIP's tokenizer from {BPE_FILE} of the {OPEN_CLIP_PIN} "
            f"package, which is not installed: run `pip install --no-deps {OPEN_CLIP_PIN}` "
            "(`make venv` does it; --no-deps: its dependencies would pull torchvision)"
        )
    return path


def clip_bpe_vocab_and_merges(bpe_path: Path) -> tuple[dict[str, int], list[str]]:
    """CLIP's ``vocab.json`` mapping (token → id) and its merges (``"a b"``) from the gzipped merges file."""
    lines = gzip.decompress(bpe_path.read_bytes()).decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1 : N_MERGES + 1]]
    byte_chars = list(_bytes_to_unicode().values())
    tokens = byte_chars + [c + END_OF_WORD for c in byte_chars] + ["".join(m) for m in merges]
    tokens += [BOS_TOKEN, EOS_TOKEN]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != VOCAB_SIZE:
        raise ValueError(f"{bpe_path} gives {len(vocab)} distinct tokens; CLIP's vocabulary has {VOCAB_SIZE}")
    return vocab, [" ".join(m) for m in merges]


def write_clip_tokenizer(out_dir: Path, max_length: int = 77) -> CLIPTokenizer:
    """Write CLIP's real tokenizer to ``out_dir`` (``vocab.json``, ``merges.txt``, then ``save_pretrained``)
    and return it: pads with ``<|endoftext|>`` to ``max_length``, as ``openai/clip-vit-large-patch14`` does."""
    vocab, merges = clip_bpe_vocab_and_merges(clip_bpe_path())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in merges), encoding="utf-8")
    tokenizer = CLIPTokenizer.from_pretrained(out_dir, model_max_length=max_length, pad_token=EOS_TOKEN)
    tokenizer.save_pretrained(out_dir)
    log.info("wrote CLIP's BPE tokenizer (%d tokens, max length %d) to %s", len(tokenizer), max_length, out_dir)
    return tokenizer
