"""Soak: twenty random tiny pairs merged in one process leave nothing behind — no model, tensor
or thread outlives its merge, and resident memory stays flat apart from allocator noise."""

from __future__ import annotations

import gc
import random
import shutil
import threading

import pytest
import torch

from raot_hf import RaotMerger, scramble
from raot_hf.testing import (
    clone,
    tiny_image_dataset,
    tiny_image_processor,
    tiny_model,
    tiny_text_dataset,
    tiny_tokenizer,
)

pytestmark = pytest.mark.slow

WARMUP, TOTAL = 3, 20
#: Resident-memory growth allowed between merge 3 and merge 20. Each merge allocates a few MB
#: (two models of ≤ 0.5 MB, their statistics, a calibration set, written shards) that glibc
#: may keep in its arenas, and torch/datasets keep small caches: measured growth over the 17
#: merges after warm-up is ~2 MB (2 cores, glibc, torch 2.13). 32 MB is >10× that noise and
#: still catches a leak of native memory (mmaps of checkpoints, Arrow tables, thread stacks);
#: Python-visible leaks (models, tensors, threads) are caught exactly by the counts below.
RSS_NOISE_BYTES = 32 * 2**20


def _live(kind: type) -> int:
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), kind))  # type(): no __class__ lookups


def _merge_random_pair(rng: random.Random, workdir) -> None:
    """Save a random tiny pair, merge it from disk with random options, write the result."""
    model_type = rng.choice(["bert", "vit"])
    head = "image" if model_type == "vit" else "sequence"
    heads = rng.choice([2, 4])
    shape = dict(
        hidden_size=heads * rng.choice([8, 16]),
        num_heads=heads,
        num_layers=rng.randint(1, 3),
        intermediate_size=rng.choice([24, 48, 96]),
    )
    seed = rng.randrange(10**6)
    a = tiny_model(model_type, head, dtype=torch.float32, seed=seed, **shape)
    if rng.random() < 0.5:
        b = clone(a)
        scramble(b, seed=seed + 1)
    else:
        b = tiny_model(model_type, head, dtype=torch.float32, seed=seed + 1, **shape)
    pre = tiny_image_processor() if model_type == "vit" else tiny_tokenizer()
    data = tiny_image_dataset(48, seed=seed) if model_type == "vit" else tiny_text_dataset(64, seed=seed)
    shutil.rmtree(workdir, ignore_errors=True)
    for name, model in (("a", a), ("b", b)):
        model.save_pretrained(workdir / name)
        pre.save_pretrained(workdir / name)
    del a, b
    options = {"merge_rule": rng.choice(["linear", "regmean"]), "alpha": rng.choice([0.3, 0.5])}
    result = RaotMerger.from_pretrained(workdir / "a", workdir / "b", **options).merge(calibration=data)
    out = result.save_pretrained(workdir / "out")
    assert (out / "model.safetensors").is_file()
    assert all(torch.isfinite(p).all() for p in result.model.parameters())


def test_twenty_merges_in_one_process_leave_nothing_behind(tmp_path):
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    rng = random.Random(2024)

    for _ in range(WARMUP):  # first-use costs: thread pools, lazy imports, tokenizer caches
        _merge_random_pair(rng, tmp_path / "pair")
    gc.collect()
    modules, tensors, threads = _live(torch.nn.Module), _live(torch.Tensor), threading.active_count()
    rss = process.memory_info().rss

    for _ in range(TOTAL - WARMUP):
        _merge_random_pair(rng, tmp_path / "pair")
    gc.collect()
    growth = process.memory_info().rss - rss

    assert _live(torch.nn.Module) <= modules, "models outlive their merge"
    assert _live(torch.Tensor) <= tensors, "tensors outlive their merge"
    assert threading.active_count() <= threads, "threads outlive their merge"
    assert growth < RSS_NOISE_BYTES, f"resident memory grew by {growth / 2**20:.1f} MB over {TOTAL - WARMUP} merges"
