"""Post-merge corrections (docs/design.md §6.7): after the merge rule, a sequential pass of A, B′
and the merged model over a few calibration examples, one layer at a time, corrects each merged
layer before the next one runs, so errors do not compound through depth.

* ``lsq`` — merged-input least squares: each Linear of a layer, in call order, refitted to the
  α-mix of the parents' outputs on the merged model's own inputs (with RegMean's shrinkage
  towards the rule's merged weight);
* ``repair`` — REPAIR for Transformers: value channels and MLP pre-activations reset to the
  α-interpolation of the parents' statistics, folded into the weights and biases.

Both keep a merge of A with an exact scramble of itself equal to A, and write nothing but merged
weights: the output loads with ``AutoModel*`` as before.
"""

from raot_hf.correction.carry import Carried, LayerCall, capture
from raot_hf.correction.fits import Site, least_squares_layer, least_squares_readers, repair_layer
from raot_hf.correction.layer import LayerPass

#: The correction methods (``correction.method``); "none" runs no pass.
CORRECTION_METHODS = ("none", "lsq", "repair")

__all__ = [
    "CORRECTION_METHODS",
    "Carried",
    "LayerCall",
    "LayerPass",
    "Site",
    "capture",
    "least_squares_layer",
    "least_squares_readers",
    "repair_layer",
]
