"""Which precision the fit moments' largest products run in (docs/design.md §4.3).

The MLP co-moment (f × f per layer) is the pass's largest product and only feeds a discrete
decision (the unit permutation), so its per-batch products may take bf16 inputs where the device
multiplies bf16 fast; the sums across batches stay float32, and float64 models keep float64.
``auto`` decides from what the hardware *is*, never from a timing (same bytes on every run): bf16
on CUDA with compute capability ≥ 8.0 and on CPUs with AMX or AVX-512 BF16. A merge reproducible
bit for bit on *any* machine pins ``float32`` (or ``bfloat16``).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("raot_hf.calibration.precision")


def cpu_bf16_units() -> str | None:
    """The CPU's bf16 matrix instructions as torch reports them (``"AMX"``, ``"AVX-512 BF16"``), or None."""
    probes = (("AMX", "_is_amx_tile_supported"), ("AVX-512 BF16", "_is_avx512_bf16_supported"))
    for name, probe in probes:
        check = getattr(torch.cpu, probe, None)
        if check is not None and check():
            return name
    return None


def resolve_moment_precision(requested: str, param_dtype: torch.dtype, device) -> tuple[torch.dtype, str]:
    """The dtype of the MLP cross moment's per-batch products, and why; ``requested``: ``auto``,
    ``float32`` or ``bfloat16`` (float64 models always get float64)."""
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
    units = cpu_bf16_units()
    if units is not None:
        return torch.bfloat16, f"auto: this CPU has bf16 matrix instructions ({units})"
    return torch.float32, "auto: this CPU has no bf16 matrix instructions (AMX or AVX-512 BF16)"


#: Unit roundoff of a 16-bit product's inputs and sums: bf16 keeps 8 significant bits, fp16 11.
_INPUT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def correlation_error_bound(product_dtype: torch.dtype | None) -> float:
    """How far a correlation read from co-moments whose per-batch products take ``product_dtype``
    may lie from the exact one (docs/design.md §4.3): rounding both inputs, and the block product
    itself — a 16-bit matrix product returns its sums in its own format — moves each block's
    Σx·y by at most ((1 + u)³ − 1)·Σ|x·y| (u the unit roundoff), so by Cauchy–Schwarz the
    correlation by at most that (deterministic); float32 accumulation adds √k·u₃₂ ≤ 2⁻¹⁷ for
    k ≤ 2¹⁴ rows (Higham and Mary 2019)."""
    if product_dtype == torch.float64:
        return 2.0**-40
    u = _INPUT_ROUNDOFF.get(product_dtype, 0.0)  # float32 (or None: the float32 rows' own) products are exact
    return (1 + u) ** 3 - 1 + 2.0**-17
