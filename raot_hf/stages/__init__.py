"""The stages of a merge, in the order data flows through them (docs/architecture.md).

``load`` → ``calibrate`` (fit) → ``solve`` → ``calibrate`` (held-out) → ``decide`` (the gate)
→ ``apply`` (+ the B′ ≡ B check) → ``combine`` (the merge rule) → ``provenance`` (the report);
writing the output directory is :mod:`raot_hf.outputs`. Each stage is a function of the
:class:`~raot_hf.stages.context.PairContext` and of what the stage before it returned.
"""
