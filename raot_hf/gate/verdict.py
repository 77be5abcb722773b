"""The basis verdict of an alignment: do A and B share a basis, and on what evidence (docs/design.md §5).
A :class:`BasisVerdict` is data; :func:`render_verdict` is the one function that turns it into a line."""

from __future__ import annotations

from dataclasses import dataclass

from raot_hf.gate.decision import TextEnum


class Verdict(TextEnum):
    """What the gate concluded about the pair's bases."""

    SHARES_BASIS = "shares_basis"  # the gate kept the identity everywhere (or the model-level check vetoed)
    SIBLINGS = "siblings"  # shares a basis: every estimate is near the identity (§5.4)
    DIFFERS_IN_BASIS = "differs_in_basis"  # estimates applied, and they passed the gate
    # applied, the merge reads as near exact, yet one token leaves the parents' path (§5.3)
    DIFFERS_NOT_EXACT = "differs_not_exact"
    SHARES_BASIS_BY_DEFAULT = "shares_basis_by_default"  # too few gate examples: the identity stands
    UNTESTED = "untested"  # no estimate could be tested: no verdict, the identity stands
    UNCHECKED = "unchecked"  # estimates applied without the gate (disabled, soft transport, no data)
    NOT_REQUESTED = "not_requested"  # no estimate to decide


@dataclass(frozen=True)
class ModelCheckFigures:
    """The merge objective's model-level check as a verdict cites it: mean fidelity of the identity
    merge and of the aligned merge on ``examples`` held-out examples, and the gain's margin."""

    identity: float
    aligned: float
    examples: int
    margin: float | None = None


@dataclass(frozen=True)
class OffPath:
    """Where the merged model leaves its parents' path (the worst token's deviation, §5.3): the
    deviation at its largest, the first layer above the note level, the layer of the largest."""

    deviation: float
    first_layer: int
    worst_layer: int


@dataclass(frozen=True)
class BasisVerdict:
    """A verdict and its evidence; which fields are set depends on the code and the objective:
    ``check`` under the merge objective (for siblings, the comparison kept as evidence),
    ``applied``/``estimates`` and ``why`` (the circumstance: "alignment objective", "gate
    disabled", the reason no test ran …) otherwise, ``off_path`` for
    :attr:`Verdict.DIFFERS_NOT_EXACT`, ``affinity`` (median, smallest) for :attr:`Verdict.SIBLINGS`."""

    code: Verdict
    why: str = ""
    applied: int = 0
    estimates: int = 0
    check: ModelCheckFigures | None = None
    off_path: OffPath | None = None
    affinity: tuple[float, float] | None = None

    text = property(lambda self: render_verdict(self))


def affinity_phrase(median: float, smallest: float) -> str:
    """The siblings' evidence in words (also the rejected decisions' reason)."""
    return f"median identity affinity {median:.3f}, smallest {smallest:.3f}, none at chance level"


def render_verdict(v: BasisVerdict) -> str:
    """The verdict's one line, with its evidence: the model-level check's fidelities when the merge
    objective decided, else the count of estimates applied."""
    c = v.check
    if v.code is Verdict.NOT_REQUESTED:
        return "no alignment requested"
    if v.code is Verdict.UNTESTED:
        return f"no basis verdict: no estimate could be tested ({v.why}); the identity stands"
    if v.code is Verdict.UNCHECKED:
        return f"no basis verdict ({v.why}): {v.applied} of {v.estimates} estimates applied unchecked"
    if v.code is Verdict.SHARES_BASIS_BY_DEFAULT:
        return f"A and B share a basis by default: {v.why}, the identity stands"
    if v.code is Verdict.SIBLINGS:
        near = affinity_phrase(*v.affinity)
        evidence = (
            ""
            if c is None
            else f"; merge fidelity, evidence only: aligned {c.aligned:.4f} vs identity {c.identity:.4f} "
            f"on {c.examples} held-out examples"
        )
        return f"A and B share a basis: fine-tuned siblings, the estimates are near the identity ({near}){evidence}"
    if v.code is Verdict.SHARES_BASIS:
        if c is None:
            return f"A and B share a basis: the gate rejected all {v.estimates} estimates ({v.why})"
        return (
            f"A and B share a basis: identity merge fidelity {c.identity:.4f}, aligned merge {c.aligned:.4f} "
            f"on {c.examples} held-out examples (no gain beyond the margin {c.margin:.2g})"
        )
    # DIFFERS_IN_BASIS, DIFFERS_NOT_EXACT
    if c is None:
        return f"A and B differ in basis: {v.applied} of {v.estimates} estimates applied ({v.why})"
    line = (
        f"A and B differ in basis: aligned merge fidelity {c.aligned:.4f} vs identity merge {c.identity:.4f} "
        f"on {c.examples} held-out examples (margin {c.margin:.2g})"
    )
    if v.code is Verdict.DIFFERS_NOT_EXACT:
        p = v.off_path
        line += (
            f"; but one token leaves the parents' path by {p.deviation:.2g} (from layer {p.first_layer}, largest at "
            f"layer {p.worst_layer}): not an exact recovery there"
        )
    return line
