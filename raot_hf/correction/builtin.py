"""The built-in corrections (docs/design.md §6.7), registered by name: ``lsq`` (merged-input
least squares, with the final readers' refit), ``repair`` (REPAIR statistics) and ``router`` (the
mixture-of-experts routers alone, by ``lsq``'s fit, §10.4), and the sites each reads in a layer."""

from __future__ import annotations

from typing import Any

import torch

from raot_hf.adapters.schema import ModelSchema
from raot_hf.correction.fits import Site, least_squares_layer, least_squares_readers, repair_layer
from raot_hf.correction.layer import shared_input_sites
from raot_hf.correction.registry import CorrectionRequest, register_correction


def stored_in_out(model: torch.nn.Module, module: str) -> bool:
    """Whether ``module`` stores its weight (in, out) (GPT-2's ``Conv1D``) rather than (out, in)."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(model.get_submodule(module), Conv1D)


def linear_sites(model, schema: ModelSchema, index: int, prefix: str) -> list[Site]:
    """Every Linear of layer ``index`` (the schema's ``linears``) as a least-squares site."""
    params = dict(model.named_parameters())
    sites = []
    for module in schema.layers[index].linears:
        if not module.startswith(prefix + ".") or f"{module}.weight" not in params:
            continue
        bias = f"{module}.bias" if f"{module}.bias" in params else None
        sites.append(Site(module[len(prefix) + 1 :], f"{module}.weight", bias, stored_in_out(model, module)))
    return sites


def repair_sites(model, schema: ModelSchema, index: int, prefix: str) -> tuple[list[Site], list[str]]:
    """The modules whose outputs REPAIR resets in layer ``index``: the value rows ("v", per KV head
    under grouped-query attention) and the MLP's pre-activations ("mlp": fc1, or gate and up).
    A space whose members are not a module's own weight and bias (DeBERTa v1's ``v_bias`` added
    after the fused projection) cannot be folded and is skipped, with the reason."""
    params = dict(model.named_parameters())
    spaces = (("v", schema.kv_space(index, "v") or schema.vo_space(index)),)
    if schema.has_mlp(index):  # a mixture-of-experts layer's experts are not one module's rows
        spaces += (("mlp", schema.mlp_space(index)),)
    sites, skipped = [], []
    for kind, space in spaces:
        members = [m for m in space.members if m.covariant and m.role in ("v", "fc1")]
        weights = [m for m in members if m.name.endswith(".weight") and params[m.name].ndim == 2]
        found = []
        for m in weights:
            module = m.name[: -len(".weight")]
            bias = f"{module}.bias" if f"{module}.bias" in params else None
            found.append(Site(module[len(prefix) + 1 :], m.name, bias, m.axis == 1, m.index_tensor(), kind))
        owned = {s.weight for s in found} | {s.bias for s in found if s.bias}
        if any(m.name not in owned for m in members) or not found:
            skipped.append(f"{space.name}: its parameters are not one module's weight and bias; not corrected")
            continue
        sites += found
    return sites, skipped


def _refit_sites(request: CorrectionRequest, sites: list, memo_key: str):
    """Refit ``sites`` of the layer, in call order, to the parents' mix on M's own inputs; layers of
    one class call their sites in one order, found once (``memo[memo_key]``)."""
    shared = request.memo.setdefault(memo_key, {})
    key = (type(request.layer.module_a), tuple(s.module for s in sites))
    if key not in shared:
        shared[key] = shared_input_sites(request.layer, request.rule, [s.module for s in sites])
    return least_squares_layer(
        request.layer, request.rule, sites, mix=request.mix, shrink=request.options.shrink, shared=shared[key]
    )


def least_squares(request: CorrectionRequest):
    """``lsq``: each Linear of the layer, in call order, refitted to the parents' mix on M's own inputs."""
    sites = linear_sites(request.model, request.schema, request.index, request.name)
    return _refit_sites(request, sites, "shared_inputs")


def router_recalibration(request: CorrectionRequest):
    """``router``: each mixture-of-experts router refitted alone, as ``lsq`` refits a Linear — to the
    parents' mixed router logits on the merged model's own inputs (docs/design.md §10.4); every
    other parameter keeps the rule's merge, and a dense layer is left as the rule made it."""
    block = request.schema.layers[request.index].experts
    router = None if block is None else f"{block.router}.weight"
    sites = [s for s in linear_sites(request.model, request.schema, request.index, request.name) if s.weight == router]
    return _refit_sites(request, sites, "router_inputs")


def least_squares_final(chunks, norms, rest, sites, *, mix, options):
    """``lsq`` on the Linears that read the final norm (an untied LM head), like the layers'."""
    return least_squares_readers(chunks, norms, rest, sites, mix=mix, shrink=options.shrink)


def least_squares_report(memo: dict, options) -> dict[str, Any]:
    """``lsq``'s report fields: the shrinkage and, per layer class, its sites gathered by the input
    they read (the report key ``groups`` is kept as it was)."""
    return {"shrink": options.shrink, "groups": [s.readers for s in memo.get("shared_inputs", {}).values()]}


def repair(request: CorrectionRequest):
    """``repair``: value channels and MLP pre-activations reset to the parents' interpolated statistics."""
    sites, why = repair_sites(request.model, request.schema, request.index, request.name)
    request.skipped += why
    return repair_layer(request.layer, request.rule, sites, mix=request.mix)


register_correction(
    "lsq",
    least_squares,
    readers=least_squares_final,
    report=least_squares_report,
    description="merged-input least squares",
)
register_correction("repair", repair, description="REPAIR statistics")
register_correction(
    "router", router_recalibration, description="mixture-of-experts routers refitted to the parents' mixed routing"
)
