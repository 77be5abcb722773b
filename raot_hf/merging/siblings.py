"""What the merger checks before a base-relative rule runs (docs/design.md §6, "The sibling path").

Task vectors ``W − W_base`` mean something only when A, B and the base share one basis. The
merger establishes that in three steps, each refusing with one line:

1. before any weights load: a base-relative rule needs a base, and a base needs such a rule
   (:func:`check_base_use`); the base's config must match A's shapes
   (:func:`raot_hf.io.loading.check_base_compatible`);
2. once loaded, data-free: A and B must each lie near the base in weight space
   (:func:`check_task_norms`) — a model from another initialisation, or the base in another
   basis, sits at ≈ √2 relative distance, a fine-tune far below 1;
3. after the gate: no transform may be applied to B (:func:`refuse_moved_b`). The gate
   compares A with B; if it moves B, B is not in A's basis, so A and B cannot both be in the
   base's — and ``B′ − base`` would subtract weights of two different bases.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch

from raot_hf.errors import RaotError
from raot_hf.io.checkpoint import prefix_variants
from raot_hf.merging.base_rules import MAX_RELATIVE_TASK_NORM, relative_task_norm

logger = logging.getLogger("raot_hf.merging")


def check_base_use(rule: str, needs_base: bool, has_base: bool, base_rules: Iterable[str]) -> None:
    """A base-relative rule without a base, or a base with a rule that ignores it: one line each."""
    if needs_base and not has_base:
        raise RaotError(
            f"merge_rule={rule!r} measures task vectors against a base model; pass --base BASE "
            "(base=... or base_model=... in Python), the checkpoint A and B were fine-tuned from."
        )
    if has_base and not needs_base:
        raise RaotError(
            f"a base model was given but merge_rule={rule!r} does not use one; choose one of "
            f"{', '.join(base_rules)} or drop --base."
        )


def base_state_for(
    names_a: Iterable[str], base_model: torch.nn.Module, missing: Iterable[str] = (), prefix: str = ""
) -> dict[str, torch.Tensor]:
    """The base's parameters under A's names, without ``missing`` (those the checkpoint lacked).

    A base loaded with another head class than A's is matched through ``prefix`` (A's
    ``base_model_prefix``): ``encoder.…`` of a bare ``BertModel`` is ``bert.encoder.…`` of
    ``BertForSequenceClassification``, and the other way round. Unmatched base parameters (its
    own head) are dropped."""
    wanted, skip = set(names_a), set(missing)
    state: dict[str, torch.Tensor] = {}
    for name, param in base_model.named_parameters():
        if name in skip:
            continue
        target = next((c for c in prefix_variants(name, prefix) if c in wanted), None)
        if target is not None:
            state[target] = param.detach()
    if not state:
        raise RaotError(
            f"the base ({type(base_model).__name__}) shares no parameter names with A; load it with A's class "
            "or as the bare model A's head class wraps."
        )
    return state


def check_task_norms(base: Mapping[str, torch.Tensor], state_a, state_b) -> dict[str, float]:
    """Relative distances of A and B from the base (median over 2-D weights); refuses a model
    that is not a fine-tune of this base in this basis."""
    norms = {"a": relative_task_norm(base, state_a), "b": relative_task_norm(base, state_b)}
    refuse_unrelated({"A": norms["a"], "B": norms["b"]})
    logger.info("relative task-vector norms: A %.3g, B %.3g", norms["a"], norms["b"])
    return norms


def refuse_unrelated(norms: Mapping[str, float]) -> None:
    """Refuse, naming it, a model (label → its median relative distance from the base) that is not
    a fine-tune of this base in this basis."""
    for label, value in norms.items():
        if value > MAX_RELATIVE_TASK_NORM:
            raise RaotError(
                f"{label} is not a fine-tune of the base in the base's basis (its weights differ from the "
                f"base's by {value:.2f} of their norm, median over matrices; fine-tunes differ by far less than "
                f"{MAX_RELATIVE_TASK_NORM:g}); pass the right --base, or merge without one (--merge-rule linear)."
            )


def refuse_moved_b(decisions, rule: str) -> None:
    """Refuse a base-relative merge when the gate applied any transform to B."""
    applied = [d for d in decisions if d.applied]
    if applied:
        kinds = ", ".join(sorted({d.transform for d in applied}))
        raise RaotError(
            f"the gate applied {len(applied)} of {len(decisions)} transforms ({kinds}): A and B do not share a "
            f"basis, so B's task vector against the base is undefined and merge_rule={rule!r} is unsound here; "
            "merge them with --merge-rule linear, regmean or fisher, or pass --alignment none if you know both "
            "are fine-tunes of the base."
        )
