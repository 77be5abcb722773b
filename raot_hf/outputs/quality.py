"""The label-free check of a merged model, as one sentence for the card (docs/design.md §6.8)."""

from __future__ import annotations

from typing import Any


def describe_quality(quality: dict[str, Any] | None) -> str | None:
    """One sentence for the card and the CLI (and one on routing for a mixture of experts)."""
    sentence = _describe_outputs(quality)
    routing = _describe_routing((quality or {}).get("routing"))
    return " ".join(s for s in (sentence, routing) if s) or None


def _describe_routing(routing: list[dict[str, Any]] | None) -> str | None:
    """The routing change per layer (docs/design.md §10.4), in one sentence."""
    if not routing:
        return None
    layers = ", ".join(f"{r['changed_a']:.0%} / {r['changed_b']:.0%}" for r in routing)
    span = f"{routing[0]['layer']}–{routing[-1]['layer']}"
    return f"Its routers choose top-k experts other than A's / B′'s on {layers} of the held-out tokens (layers {span})."


def _describe_outputs(quality: dict[str, Any] | None) -> str | None:
    if not quality or "positions" not in quality:
        return None
    n, k = quality["examples"], quality["positions"]
    where = f"{k} predictions on {n} held-out calibration examples" if k != n else f"{n} held-out calibration examples"
    if "agreement_a" in quality or "agreement_b" in quality:
        parts = []
        for side, name in (("a", "A"), ("b", "B′")):
            if f"agreement_{side}" in quality:
                parts.append(f"what {name} predicts {quality[f'agreement_{side}']:.1%} of the time")
        both = f" (A and B′ agree {quality['parents_agreement']:.1%})" if "parents_agreement" in quality else ""
        kl = "; ".join(
            f"KL({name}‖merged) {quality[f'kl_{side}']:.3f} nats"
            for side, name in (("a", "A"), ("b", "B′"))
            if f"kl_{side}" in quality
        )
        return f"On {where}, the merged model predicts {' and '.join(parts)}{both}; {kl}."
    if "error_a" not in quality:
        return None
    return (
        f"On {where}, the merged model's hidden states differ from A's by {quality['error_a']:.3f} and from "
        f"B′'s by {quality['error_b']:.3f} (relative squared error)."
    )
