"""Which precision the fit moments' largest products run in (docs/design.md §4.3, issue 15).

The MLP cross moment Σaᵀb (f × f per layer) is the largest product of the calibration pass:
per token and layer about 16·d² multiply-adds against the two forwards' ~24·d². Its only use is
a discrete decision — the unit permutation, from correlations whose sampling noise over n tokens
is 1/√n — so its per-batch products may take bf16 inputs (rounding ~4e-3 relative per entry,
independent across batches) where the device multiplies bf16 much faster than float32; the sums
across batches stay float32. The head and stream moments feed continuous rotations and keep
float32; float64 models keep float64 everywhere (the exactness tests run there).

``auto`` decides per device: on CUDA, bf16 where the GPU has bf16 tensor cores (compute
capability ≥ 8.0); on a CPU, a micro-benchmark once per process (a 256³ product in each dtype,
best of three) picks bf16 only when it runs at least :data:`MIN_SPEEDUP` times faster — CPUs
with AMX or AVX-512 BF16 do; CPUs with AVX2 only run bf16 products far slower than float32.
The choice depends on a measurement, so a merge that must be reproducible bit for bit on any
machine pins ``float32`` (or ``bfloat16``); the measured speed-up is logged, not written.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

logger = logging.getLogger("raot_hf.calibration.precision")

#: How much faster a bf16 product must be than float32 for ``auto`` to choose it on a CPU.
MIN_SPEEDUP = 1.5
_BENCH_SIZE = 256


def _best_time(fn, repeats: int = 3) -> float:
    fn()  # warm-up (kernel selection, packing)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


@functools.lru_cache(maxsize=8)
def cpu_bf16_speedup(threads: int) -> float:
    """float32 time / bf16 time of a 256³ CPU matrix product with ``threads`` threads (cached)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(_BENCH_SIZE, _BENCH_SIZE, generator=g)
    y = torch.randn(_BENCH_SIZE, _BENCH_SIZE, generator=g)
    xb, yb = x.bfloat16(), y.bfloat16()
    return _best_time(lambda: x @ y) / _best_time(lambda: xb @ yb)


def resolve_moment_precision(requested: str, param_dtype: torch.dtype, device) -> tuple[torch.dtype, str]:
    """The dtype of the MLP cross moment's per-batch products, and why.

    ``requested`` is ``auto``, ``float32`` or ``bfloat16``; ``param_dtype`` the models' dtype
    (float64 models always get float64); ``device`` where the moments are computed."""
    if param_dtype == torch.float64:
        return torch.float64, "float64 model: float64 moments"
    if requested == "float32":
        return torch.float32, "requested"
    if requested == "bfloat16":
        return torch.bfloat16, "requested"
    device = torch.device(device)
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major >= 8:
            return torch.bfloat16, f"auto: CUDA compute capability {major}.x has bf16 tensor cores"
        return torch.float32, f"auto: CUDA compute capability {major}.x has no bf16 tensor cores"
    if device.type != "cpu":
        return torch.float32, f"auto: no bf16 rule for {device.type}"
    speedup = cpu_bf16_speedup(torch.get_num_threads())
    fast = speedup >= MIN_SPEEDUP
    choice = torch.bfloat16 if fast else torch.float32
    # the measured speed varies run to run: it is logged, and kept out of the written files
    why = f"auto: bf16 products run {'at least' if fast else 'less than'} {MIN_SPEEDUP}× float32's speed on this CPU"
    logger.info("moment precision %s (a bf16 product ran %.2f× as fast as float32)", choice, speedup)
    return choice, why
