"""The label-free check of a merged model, as one sentence for the card (docs/design.md §6.8)."""

from __future__ import annotations

from typing import Any


def describe_quality(quality: dict[str, Any] | None) -> str | None:
    """One sentence for the card and the CLI."""
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
