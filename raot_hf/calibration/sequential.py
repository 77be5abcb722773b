"""The calibration pass layer by layer (docs/design.md §7.4): every batch through layer 0 of A and
B, then every batch through layer 1, and so on, on hidden states carried from the layer before.

Offloaded layers are read once per phase, and a layer's fit moments are complete once the last
batch has left it (``on_layer(i)`` may solve and free them). A's layer and then B's run in the
caller's thread (:meth:`StatisticsCollector.observe_in_turn`). The activations folded are the
batch-by-batch pass's, in the same order per site; only the residual stream's moment adds its
terms in another order (float64 rounding). Each layer's call (masks, rotary embeddings, DeBERTa's
relative embeddings) is captured once per batch from a forward that reads no layer's weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from huggingface_hub.utils import tqdm

from raot_hf.calibration.batches import CalibrationBatch
from raot_hf.calibration.collector import StatisticsCollector
from raot_hf.correction.carry import LayerCall, layer0_call, layer_calls
from raot_hf.stages.context import on_device_of


@dataclass
class _Batch:
    """One batch on its way through the layers: its row selection, and per model the layer calls and
    the hidden states entering the next layer."""

    batch: CalibrationBatch
    rows: tuple
    calls: dict[str, list[LayerCall]]
    hidden: dict[str, torch.Tensor]
    kept: object = None  # what of the batch the capture keeps (raot_hf.calibration.kept.KeptBatch)


def _enter(
    collector: StatisticsCollector, batches: Iterable[CalibrationBatch], names: list[str], entering=None
) -> list[_Batch]:
    """Every batch of this phase up to layer 0 of both models (embeddings observed), with its layer
    calls (``entering(batch)``: what of it a capture keeps)."""
    carried = []
    models = {"a": collector.model_a, "b": collector.model_b}
    tails: dict = {}  # layer 0's output structure, learnt once for the phase (layer_calls)
    for batch in batches:
        if not collector.begin(batch):
            continue
        calls = {
            side: layer_calls(model, names, on_device_of(model, batch.inputs), tails=tails)[0]
            for side, model in models.items()
        }
        hidden: dict[str, torch.Tensor] = {}

        def run(side, batch=batch, hidden=hidden):  # observed: the embeddings' stream sites
            model = models[side]
            hidden[side] = layer0_call(model, names[0], on_device_of(model, batch.inputs))[1]

        collector.observe_in_turn(lambda run=run: run("a"), lambda run=run: run("b"))
        kept = entering(batch) if entering is not None else None
        carried.append(_Batch(batch, collector.rows_state(), calls, hidden, kept))
    return carried


@torch.no_grad()
def observe_layer_by_layer(
    collector: StatisticsCollector,
    batches: Iterable[CalibrationBatch],
    layer_names: list[str],
    *,
    on_layer: Callable[[int], None] | None = None,
    progress: bool = False,
    desc: str = "calibration",
    capture=None,
    entering=None,
) -> int:
    """Fold this phase's batches into ``collector``'s sums layer by layer (``layer_names`` in order);
    ``on_layer(i)`` runs once layer ``i`` has seen every batch; ``capture`` (an
    :class:`raot_hf.calibration.kept.OutputCapture`) keeps what ``entering(batch)`` says of each
    batch as its layers run. Returns the number of batches folded."""
    carried = _enter(collector, batches, layer_names, entering)
    try:
        for i in tqdm(range(len(layer_names)), desc=desc, disable=not progress):
            collector.start_layer(i)
            module_a = collector.model_a.get_submodule(layer_names[i])
            module_b = collector.model_b.get_submodule(layer_names[i])
            for item in carried:
                collector.begin(item.batch, item.rows)
                out: dict[str, torch.Tensor] = {}

                def run(side, module, item=item, out=out, i=i):
                    out[side] = item.calls[side][i](module, item.hidden[side])

                if capture is not None:
                    capture.observing(item.kept)
                run_a, run_b = (lambda run=run, m=module_a: run("a", m)), (lambda run=run, m=module_b: run("b", m))
                collector.observe_in_turn(run_a, run_b)
                item.hidden, item.rows = out, collector.rows_state()
            if capture is not None:
                capture.observing(None)
            if on_layer is not None:
                on_layer(i)
    finally:
        if capture is not None:
            capture.observing(None)
    for item in carried:
        collector.begin(item.batch, item.rows)
        collector.finish(item.batch)
    return len(carried)
