"""Every benchmarked method, as options of the product (fields of :class:`raot_hf.RaotConfig`).

Nothing here merges or aligns by itself: each method is a dict of options passed to
``RaotMerger.from_pretrained(a, b, **options)`` (base-relative rules also get the pair's base
model). Literature baselines run ungated (as published); RaOT's ablations keep the gate unless
the ablation is the gate.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Method:
    """One row of the results tables."""

    name: str
    label: str
    options: dict[str, Any] = field(default_factory=dict)
    #: "alignment" (linear rule), "rules" (RegMean / Fisher / corrections), "base" (base-relative),
    #: "mergekit" (mergekit's rules that need no base: SLERP)
    group: str = "alignment"
    needs: str | None = None  # a Python package the method needs (skipped with a note if absent)
    needs_base: bool = False  # a base-relative rule: runs only on pairs with a base model

    @property
    def linear(self) -> bool:
        """Whether the merge is the linear rule, uncorrected (the loss-barrier path applies). A row
        that leaves the correction to the product (``auto``) may be corrected, so it is not."""
        corrected = self.options.get("correction", {}).get("method", "auto") != "none"
        return self.options.get("merge_rule", "linear") == "linear" and not corrected

    @property
    def aligned(self) -> bool:
        return self.options.get("alignment", "activation") != "none"


METHODS: tuple[Method, ...] = (
    Method("average", "plain average (no alignment)", {"alignment": "none"}),
    Method(
        "wm-perm",
        "weight matching, permutations only (Git Re-Basin style, ungated)",
        {"alignment": "weight", "rotations": False, "gate": False},
    ),
    Method(
        "wm-rot",
        "weight-based rotation matching (rotation-symmetry paper, ungated)",
        {"alignment": "weight", "gate": False},
    ),
    Method(
        "wm-rot-rescale",
        "weight-based rotation matching + rescaling (paper, ungated)",
        {"alignment": "weight", "weight_rescale": True, "gate": False},
    ),
    Method("soft-ot", "soft OT alignment (Sinkhorn plans, OT fusion)", {"alignment": "soft_ot"}, needs="ot"),
    Method(
        "act-perm",
        "activation permutations only (MLP units + heads + residual permutation, gated)",
        {"alignment": "activation", "rotations": False, "residual": "permutation"},
    ),
    Method("raot", "RaOT (full: MLP + heads with rotations + residual, gated)", {"alignment": "activation"}),
    Method(
        "raot-oldgate",
        "RaOT with the alignment-objective gate (the gate before the merge objective; ablation)",
        {"alignment": "activation", "gate_objective": "alignment"},
    ),
    Method(
        "raot-nosibcheck",
        "RaOT with the merge gate but without sibling detection (lets the gate repair siblings' drift; ablation)",
        {"alignment": "activation", "sibling_check": False},
    ),
    Method("raot-nogate", "RaOT without the gate", {"alignment": "activation", "gate": False}),
    Method(
        "raot-norope",
        "RaOT with free Q/K head rotations, ignoring RoPE (inexact on RoPE models; ablation)",
        {"alignment": "activation", "rope_restricted": False},
    ),
    Method(
        "raot-stride4",
        "RaOT with fit moments from every 4th token",
        {"alignment": "activation", "calibration": {"moment_stride": 4}},
    ),
    Method(
        "raot-stride8",
        "RaOT with fit moments from every 8th token",
        {"alignment": "activation", "calibration": {"moment_stride": 8}},
    ),
    Method(
        "raot-fp32moments",
        "RaOT with float32 MLP cross-moment products (the precision auto chooses on CPUs without fast bf16)",
        {"alignment": "activation", "calibration": {"moment_precision": "float32"}},
    ),
    Method(
        "raot-bf16moments",
        "RaOT with bf16 MLP cross-moment products (what auto chooses where bf16 products are fast)",
        {"alignment": "activation", "calibration": {"moment_precision": "bfloat16"}},
    ),
    Method(
        "raot-budget16",
        "RaOT with the MLP cross moments from at most 16 tokens per MLP unit (random positions)",
        {"alignment": "activation", "calibration": {"mlp_tokens_per_unit": 16}},
    ),
    Method("raot-heads", "RaOT ablation: attention heads only", {"alignment": "activation", "scope": ("heads",)}),
    Method("raot-mlp", "RaOT ablation: MLP units only", {"alignment": "activation", "scope": ("mlp",)}),
    Method("raot-nores", "RaOT ablation: residual stream off", {"alignment": "activation", "scope": ("mlp", "heads")}),
    Method("regmean", "RegMean, no alignment", {"alignment": "none", "merge_rule": "regmean"}, "rules"),
    Method(
        "wm-rot+regmean",
        "RegMean after weight-based rotation matching",
        {"alignment": "weight", "gate": False, "merge_rule": "regmean"},
        "rules",
    ),
    Method("raot+regmean", "RegMean after RaOT", {"alignment": "activation", "merge_rule": "regmean"}, "rules"),
    Method(
        "raot+lsq",
        "RaOT, then merged-input least squares layer by layer (post-merge correction)",
        {"alignment": "activation", "correction": {"method": "lsq"}},
        "rules",
    ),
    Method(
        "raot+lsq-z3",
        "RaOT, then least squares, each layer's correction held to the gate's z = 3 on held-out examples",
        {"alignment": "activation", "correction": {"method": "lsq", "z": 3.0}},
        "rules",
    ),
    Method(
        "raot+lsq-nocompete",
        "RaOT, then least squares in every layer, untested on held-out examples (no competition)",
        {"alignment": "activation", "correction": {"method": "lsq", "compete": False}},
        "rules",
    ),
    Method(
        "raot+repair",
        "RaOT, then REPAIR statistics layer by layer (post-merge correction)",
        {"alignment": "activation", "correction": {"method": "repair"}},
        "rules",
    ),
    Method(
        "raot+regmean+lsq",
        "RegMean after RaOT, then merged-input least squares layer by layer",
        {"alignment": "activation", "merge_rule": "regmean", "correction": {"method": "lsq"}},
        "rules",
    ),
    Method(
        "raot+lsq-all",
        "RaOT, then merged-input least squares on every fit example (up to 1,024)",
        {"alignment": "activation", "correction": {"method": "lsq", "examples": 1024}},
        "rules",
    ),
    Method(
        "raot+refine",
        "RaOT, then the learned alignment (200 label-free gradient steps on the continuous symmetries)",
        {"alignment": "activation", "refine": {"steps": 200}},
    ),
    Method(
        "raot+refine+lsq",
        "RaOT, the learned alignment, then merged-input least squares layer by layer",
        {"alignment": "activation", "refine": {"steps": 200}, "correction": {"method": "lsq"}},
        "rules",
    ),
    Method(
        "lsq",
        "merged-input least squares layer by layer, no alignment",
        {"alignment": "none", "correction": {"method": "lsq"}},
        "rules",
    ),
    Method(
        "fisher",
        "Fisher averaging (label-free diagonal), no alignment",
        {"alignment": "none", "merge_rule": "fisher"},
        "rules",
    ),
    Method(
        "wm-rot+fisher",
        "Fisher averaging after weight-based rotation matching",
        {"alignment": "weight", "gate": False, "merge_rule": "fisher"},
        "rules",
    ),
    Method("raot+fisher", "Fisher averaging after RaOT", {"alignment": "activation", "merge_rule": "fisher"}, "rules"),
    Method(
        "task-arithmetic",
        "task arithmetic with the base (no alignment)",
        {"alignment": "none", "merge_rule": "task_arithmetic"},
        "base",
        needs_base=True,
    ),
    Method(
        "ties",
        "TIES with the base (no alignment)",
        {"alignment": "none", "merge_rule": "ties"},
        "base",
        needs_base=True,
    ),
    Method(
        "dare-ties",
        "DARE-TIES with the base (no alignment)",
        {"alignment": "none", "merge_rule": "dare_ties"},
        "base",
        needs_base=True,
    ),
    Method(
        "raot+ties",
        "TIES with the base after RaOT",
        {"alignment": "activation", "merge_rule": "ties"},
        "base",
        needs_base=True,
    ),
    # mergekit's rules (raot_hf/merging/mergekit_rules.py, docs/design.md §6.10), mergekit's defaults
    # except where a default would make the rule a no-op (DELLA's density 1 drops nothing).
    Method(
        "slerp",
        "mergekit's SLERP, t = 0.5 from A to B (no alignment)",
        {"alignment": "none", "merge_rule": "slerp", "mergekit": {"t": 0.5}},
        "mergekit",
    ),
    Method(
        "slerp-raot",
        "mergekit's SLERP, t = 0.5, of A and B′ after RaOT (gated)",
        {"alignment": "activation", "merge_rule": "slerp", "mergekit": {"t": 0.5}},
        "mergekit",
    ),
    Method(
        "model-stock",
        "mergekit's Model Stock with the base (no alignment)",
        {"alignment": "none", "merge_rule": "model_stock"},
        "base",
        needs_base=True,
    ),
    Method(
        "della",
        "mergekit's DELLA with the base, density 0.7, epsilon 0.15, lambda 1 (no alignment)",
        {"alignment": "none", "merge_rule": "della", "mergekit": {"density": 0.7, "epsilon": 0.15, "scale": 1.0}},
        "base",
        needs_base=True,
    ),
)


def _pinned(method: Method) -> Method:
    """Every row but ``default`` states its post-merge correction and refit (none unless it names
    them), so the alignment rows stay alignment-only whatever the product's defaults are."""
    if method.name == "default":
        return method
    options = {"correction": {"method": "none"}, "refit": {"mode": "off"}, **method.options}
    return replace(method, options=options)


METHODS = (
    Method("default", "the product's defaults (RaOT, linear, correction auto, refit auto)", {}, "rules"),
    Method(
        "default-cap2k",
        "the product's defaults with each MLP cross moment from at most 2,048 fit tokens (the token cap, "
        "forced to bind on the benchmark calibrations)",
        {"calibration": {"mlp_cross_tokens": 2048}},
        "rules",
    ),
    Method(
        "default-hcap2k",
        "the product's defaults with each query, key, context and stream cross moment from at most 2,048 fit "
        "tokens (the d × d token cap, forced to bind on the benchmark calibrations)",
        {"calibration": {"hidden_cross_tokens": 2048}},
        "rules",
    ),
    Method(
        "default-staged",
        "the product's defaults with the gate, the apply and the correction as three passes (no one sweep)",
        {"gate": {"sweep": False}},
        "rules",
    ),
    Method(
        "default-norefit",
        "the product's defaults with the refit off (the correction's merge, as the default was before the refit)",
        {"refit": {"mode": "off"}},
        "rules",
    ),
    Method(
        "default+refit-hidden",
        "the product's defaults with the refit following the parents' last stream (relative squared error) "
        "instead of their predictions",
        {"refit": {"target": "hidden"}},
        "rules",
    ),
    Method(
        "default+refit-1000",
        "the product's defaults with the refit's steps fixed at 1,000 instead of its time budget (1 × the rest of "
        "the merge)",
        {"refit": {"steps": 1000}},
        "rules",
    ),
    Method(
        "default+refit-confident",
        "the product's defaults with the refit's confident teacher (per token, each parent's prediction weighted "
        "by exp(−entropy))",
        {"refit": {"teacher": "confident"}},
        "rules",
    ),
    Method(
        "default+refit",
        "the correction, then the refit of the merged model's norms and biases towards the parents' last stream "
        "(200 label-free steps, lr 1e-3, patience 3)",
        {
            "refit": {
                "mode": "on",
                "steps": 200,
                "lr": 1e-3,
                "patience": 3,
                "parameters": "norms_biases",
                "target": "hidden",
            }
        },
        "rules",
    ),
    Method(
        "default+refit-all",
        "the correction, then the refit of every trunk parameter towards the parents' last stream (300 label-free "
        "steps, lr 1e-4, patience 3)",
        {"refit": {"mode": "on", "steps": 300, "lr": 1e-4, "patience": 3, "parameters": "all", "target": "hidden"}},
        "rules",
    ),
    *(_pinned(m) for m in METHODS),
)
BY_NAME = {m.name: m for m in METHODS}

#: Methods whose barrier curves are drawn (the full set is in results.json).
BARRIER_PLOT_METHODS = ("average", "wm-rot", "act-perm", "raot")


#: Names the product may give the base model's keyword of ``RaotMerger.from_pretrained``.
BASE_KEYWORDS = ("base", "base_model", "base_model_name_or_path")


def base_keyword() -> str | None:
    """The keyword of ``RaotMerger.from_pretrained`` that takes the base model, if it has one."""
    import inspect

    from raot_hf import RaotMerger

    params = inspect.signature(RaotMerger.from_pretrained).parameters
    return next((k for k in BASE_KEYWORDS if k in params), None)


def unavailable(method: Method) -> str | None:
    """Why the product cannot run ``method`` now (a missing package, option or merge rule), or None.

    The options are checked by the product itself: ``RaotConfig`` refuses an unknown option or
    merge rule."""
    from raot_hf.config import RaotConfig
    from raot_hf.errors import RaotError

    if method.needs and importlib.util.find_spec(method.needs) is None:
        return f"package {method.needs!r} is not installed"
    try:
        RaotConfig.from_dict(dict(method.options))
    except TypeError as exc:  # an option RaotConfig does not have (yet)
        return f"not available: {exc}"
    except RaotError as exc:
        return f"not available: {exc}"
    if method.needs_base and base_keyword() is None:
        return "not available: RaotMerger.from_pretrained takes no base model"
    return None


def available_methods(names: list[str] | None = None) -> tuple[list[Method], list[str]]:
    """The methods to run (all, or those named) and notes for the ones skipped (see :func:`unavailable`)."""
    notes = []
    chosen = []
    for name in names or list(BY_NAME):
        if name not in BY_NAME:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(BY_NAME)}")
        reason = unavailable(BY_NAME[name])
        if reason:
            notes.append(f"method {name} skipped: {reason}")
        else:
            chosen.append(BY_NAME[name])
    return chosen, notes
