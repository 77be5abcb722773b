"""The map of a Linear's outputs under a transform (docs/design.md §5.7): B′'s Linear on B′'s
input computes B's output under :func:`raot_hf.symmetry.output_map`, at every Linear of every
layer, on every architecture — what lets the one sweep read B's outputs kept from the calibration
pass instead of running B′'s layers."""

import pytest
import torch

from raot_hf import schema_for
from raot_hf.calibration import CalibrationConfig, iter_calibration_batches
from raot_hf.correction.builtin import stored_in_out
from raot_hf.gate.fidelity import layer_module_names
from raot_hf.hooks import Hooks, first_tensor
from raot_hf.symmetry import map_output_rows, output_map, random_group_element, transform_model
from raot_hf.testing import architectures, clone, tiny_data, tiny_model


def _outputs(model, modules: list[str], inputs: dict) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}

    def keep(name, out) -> None:  # the first call: DeBERTa runs its projections again on relative embeddings
        seen.setdefault(name, first_tensor(out))

    with torch.no_grad(), Hooks() as hooks:
        for name in modules:
            hooks.on_output(model.get_submodule(name), lambda _a, out, n=name: keep(n, out))
        model(**inputs)
    return seen


@pytest.mark.parametrize("model_type", architectures())
def test_every_linear_output_of_the_transformed_model_is_the_mapped_output_of_the_original(model_type):
    a = tiny_model(model_type, num_layers=2)
    schema = schema_for(a)
    transform = random_group_element(schema, seed=5)
    b = transform_model(clone(a), schema, transform)
    pre, data = tiny_data(model_type, 4)
    inputs = next(iter_calibration_batches(data, pre, CalibrationConfig(num_samples=4))).inputs
    linears = [m for layer in schema.layers for m in layer.linears]
    before, after = _outputs(a, linears, inputs), _outputs(b, linears, inputs)
    actions = dict(transform.space_actions(schema))
    # float64 models, but Llama's and DeBERTa v1's norms compute in float32 (the input rounded at 1e-7)
    tol = 1e-6
    moved = 0
    for name in linears:
        mapping = output_map(schema, actions, f"{name}.weight", 1 if stored_in_out(a, name) else 0)
        moved += bool(mapping)
        got = map_output_rows(before[name], mapping)
        assert torch.allclose(got, after[name], rtol=tol, atol=tol * float(after[name].abs().max())), name
    assert moved and layer_module_names(a, schema)
