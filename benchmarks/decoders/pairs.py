"""The benchmarked decoder pairs and how their parents are built (cached in the zoo cache).

* **Seeds, width series** — ``{gpt2,llama}-seeds-d{32,64,128}``: two decoders of one recipe
  trained from scratch on the review corpus, differing only in seed (initialization and data
  order); three runs per width (every pair of seeds {0, 1, 2}). 2 layers, 4 query heads (Llama:
  2 KV heads, RoPE, untied embeddings; GPT-2: tied embeddings, learned positions).
* **Deeper** — ``{gpt2,llama}-seeds-d128-l4``: the same recipe with 4 layers at d = 128 (the
  2-layer families are shallower than any real decoder; these show whether the figures hold with depth).
* **Siblings** — ``llama-siblings``: one Llama (d = 64) trained on both corpora (the *base*),
  fine-tuned once on reviews (A) and once on speeches (B) with the base's seed; three runs, one
  per base seed. The gate must say "shares a basis".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

WIDTHS = (32, 64, 128)
SEED_PAIRS = ((0, 1), (0, 2), (1, 2))
#: From-scratch recipe (every width): AdamW, cosine schedule, 32 texts × ≤ 64 tokens per step.
PRETRAIN = {"steps": 500, "batch_size": 32, "learning_rate": 3e-3}
#: Fine-tuning recipe of the siblings: fewer steps at a lower learning rate, from the base.
FINETUNE = {"steps": 150, "batch_size": 32, "learning_rate": 1e-3}
SIBLING_WIDTH = 64


@dataclass(frozen=True)
class DecoderPair:
    """One benchmarked family: how to build A, B (and the base) of each run, and its corpora."""

    name: str
    arch: str
    width: int
    runs: tuple[tuple[int, int], ...]
    siblings: bool = False
    layers: int = 2

    @property
    def corpora(self) -> tuple[str, ...]:
        """Where perplexity is measured: reviews; for siblings both fine-tuning corpora."""
        return ("reviews", "speeches") if self.siblings else ("reviews",)

    @property
    def calibration_corpus(self) -> str:
        return "mixed" if self.siblings else "reviews"


def decoder_pairs() -> list[DecoderPair]:
    """Every family, width series first."""
    pairs = [DecoderPair(f"{arch}-seeds-d{w}", arch, w, SEED_PAIRS) for arch in ("gpt2", "llama") for w in WIDTHS]
    pairs.append(DecoderPair("llama-siblings", "llama", SIBLING_WIDTH, ((0, 0), (1, 1), (2, 2)), siblings=True))
    pairs += [DecoderPair(f"{arch}-seeds-d128-l4", arch, 128, SEED_PAIRS, layers=4) for arch in ("gpt2", "llama")]
    return pairs


def pretrained(arch: str, width: int, seed: int, corpus: str, cache_dir: str | None, layers: int = 2) -> Path:
    """A decoder of ``layers`` layers trained from scratch on ``corpus`` (cached by every setting)."""
    from benchmarks.decoders.lm import VOCAB_SIZE, build_lm
    from raot_hf.demo import cached_build

    params: dict[str, Any] = {
        "kind": "bench-decoder",
        "arch": arch,
        "width": width,
        "seed": seed,
        "corpus": corpus,
        "vocab_size": VOCAB_SIZE,
        **PRETRAIN,
        **({"layers": layers} if layers != 2 else {}),  # the 2-layer models keep their cache keys
    }
    depth = f"-l{layers}" if layers != 2 else ""
    return cached_build(
        f"bench-{arch}-d{width}{depth}-{corpus}-seed{seed}", params, lambda out: build_lm(params, out), cache_dir
    )


def finetuned(base: Path, seed: int, corpus: str, cache_dir: str | None) -> Path:
    """``base`` fine-tuned on ``corpus`` (cached by every setting and the base's folder name)."""
    from benchmarks.decoders.lm import build_lm
    from raot_hf.demo import cached_build

    params = {"kind": "bench-decoder-finetune", "base": base.name, "seed": seed, "corpus": corpus, **FINETUNE}
    return cached_build(
        f"bench-ft-{corpus}-{base.name[:40]}", params, lambda out: build_lm(params, out, base=base), cache_dir
    )


def pretrained_specs(pair: DecoderPair) -> list[tuple[str, int, int, str, int]]:
    """(arch, width, seed, corpus, layers) of every from-scratch model the pair's runs need."""
    corpus = "mixed" if pair.siblings else "reviews"
    seeds = sorted({s for run in pair.runs for s in (run[:1] if pair.siblings else run)})
    return [(pair.arch, pair.width, seed, corpus, pair.layers) for seed in seeds]


def run_models(pair: DecoderPair, run: int, cache_dir: str | None) -> dict[str, Path | None]:
    """Directories of A, B and (siblings) the base of run ``run``, building what is missing."""
    seed_a, seed_b = pair.runs[run]
    if not pair.siblings:
        return {
            "a": pretrained(pair.arch, pair.width, seed_a, "reviews", cache_dir, pair.layers),
            "b": pretrained(pair.arch, pair.width, seed_b, "reviews", cache_dir, pair.layers),
            "base": None,
        }
    base = pretrained(pair.arch, pair.width, seed_a, "mixed", cache_dir)
    return {
        "a": finetuned(base, seed_a, "reviews", cache_dir),
        "b": finetuned(base, seed_a, "speeches", cache_dir),
        "base": base,
    }
