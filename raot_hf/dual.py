"""Merging two-tower models — CLIP, SigLIP (docs/design.md §11).

A two-tower model is two encoders whose projections meet in one joint space, where the logits are
scaled cosines. Each tower has the group of its own family; the joint space admits one orthogonal
map acting on both projections' outputs (a cosine is invariant under it) and nothing more. The
merge runs in three steps, each a plain function of the models and the paired data:

1. **the joint map** U, estimated from paired image–text calibration data (the held-out split
   judges it against the identity, and a near-identity U is left alone as between siblings),
   applied to B's projections (:func:`estimate_joint_map`, :func:`joint_decision`);
2. **each tower** aligned and merged by the pipeline of its family (:class:`raot_hf.RaotMerger`
   on the tower with its projection), writing into A's tower;
3. **the scalars** outside both towers (the logit scale and bias): the parents' weighted mean.

The report adds, for A, B and the merge, the image–text retrieval accuracy on the held-out pairs.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from raot_hf.adapters import DualEncoderSpec, get_dual_encoder
from raot_hf.adapters.schema import Fold, Member, ModelSchema, Space
from raot_hf.calibration import CalibrationConfig, load_calibration_dataset
from raot_hf.calibration.batches import iter_calibration_batches
from raot_hf.calibration.statistics import Moments, PairedDiagonal
from raot_hf.config import RaotConfig
from raot_hf.errors import RaotError
from raot_hf.estimators.activation import estimate_residual_map, residual_gains
from raot_hf.gate import GateDecision, Status
from raot_hf.gate import decide as decide_one
from raot_hf.gate.lineage import SIBLING_AFFINITY, identity_affinity
from raot_hf.gate.verdict import BasisVerdict, Verdict
from raot_hf.merger import RaotMerger, register_two_tower_merger
from raot_hf.outputs.record import MergeReport
from raot_hf.results import Alignment, MergeResult
from raot_hf.symmetry import ResidualRotation, TransformSequence, fold_model, transform_model

logger = logging.getLogger("raot_hf.dual")
_F64 = torch.float64


# -- the towers and the joint space ---------------------------------------------------------------------
def tower_models(spec: DualEncoderSpec, model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Each tower with its projection, as the model its family resolves: the transformers class that
    holds them (``wrapper``, built on the meta device around the two-tower model's own modules: no
    parameter is copied) or the tower itself; keyed by the tower's modality."""
    import transformers

    from raot_hf.adapters import tower_family

    out = {}
    for tower in spec.towers:
        sub = getattr(model, tower.prefix)
        if tower.wrapper is None:
            wrapped = sub
        else:
            config = copy.deepcopy(sub.config)
            config.projection_dim = model.config.projection_dim
            with torch.device("meta"):
                wrapped = getattr(transformers, tower.wrapper)(config)
            setattr(wrapped, tower.prefix, sub)
            setattr(wrapped, tower.projection, getattr(model, tower.projection))
        out[tower_family(spec, tower).modality] = wrapped.eval()
    return out


def joint_schema(spec: DualEncoderSpec, model: torch.nn.Module) -> ModelSchema:
    """The joint space as a schema whose stream it is: its writers and readers, and the LayerNorm in it
    folded into its readers (SigLIP's pooling head). Without a norm all of O(p) acts (the cosine reads
    the space); with one, the maps that fix its mean axis once it is folded (docs/design.md §11.2)."""
    params = dict(model.named_parameters())
    joint = spec.joint
    name, axis = joint.writers[0]
    space = Space("residual", "residual", params[name].shape[axis])
    for name, axis in joint.writers:
        if name in params:
            space.members.append(Member(name, axis, True, "writer"))
    for name, axis in joint.readers:
        space.members.append(Member(name, axis, False, "reader"))
    folds = []
    if joint.norm is not None:
        space.members += [
            Member(f"{joint.norm}.weight", 0, True, "norm"),
            Member(f"{joint.norm}.bias", 0, True, "norm_bias"),
        ]
        readers = tuple((f"{r}.weight", f"{r}.bias" if f"{r}.bias" in params else None) for r in joint.norm_readers)
        folds.append(Fold(f"{joint.norm}.weight", f"{joint.norm}.bias", readers))
    space.exact = "mean_fixing" if joint.norm is not None else "orthogonal"
    return ModelSchema(
        model_type=model.config.model_type, architecture=type(model).__name__, norm="pre", num_layers=0,
        hidden_size=space.size, num_heads=1, head_size=space.size, intermediate_size=0,
        spaces={"residual": space}, layers=[], stream_modules=[], folds=folds,
        stream_centered=joint.norm is not None,
    )  # fmt: skip


# -- paired embeddings -----------------------------------------------------------------------------------
@dataclass
class PairedEmbeddings:
    """Each model's unit-norm text and image embeddings of the calibration pairs (example order),
    and which pairs are held out."""

    text: dict[str, torch.Tensor]
    image: dict[str, torch.Tensor]
    heldout: torch.Tensor

    def rows(self, side: str, heldout: bool) -> torch.Tensor:
        """Both modalities' embeddings of one split, stacked (texts, then images)."""
        keep = self.heldout == heldout
        return torch.cat([self.text[side][keep], self.image[side][keep]])


@torch.no_grad()
def joint_embeddings(
    models: dict[str, torch.nn.Module], processor, dataset, config: CalibrationConfig
) -> PairedEmbeddings:
    """The unit-norm text and image embeddings (float64) of every model of ``models`` on the sample's pairs,
    batches of texts and of images taken over the same examples."""
    texts = iter_calibration_batches(dataset, processor.tokenizer, config)
    images = iter_calibration_batches(dataset, processor.image_processor, config)
    text = {side: [] for side in models}
    image = {side: [] for side in models}
    heldout = []
    for t, i in zip(texts, images, strict=True):
        heldout.append(t.heldout.bool())
        inputs = {k: v for k, v in t.inputs.items() if k in ("input_ids", "attention_mask")}
        for side, model in models.items():
            out = model(**inputs, pixel_values=i.inputs["pixel_values"].to(next(model.parameters()).dtype))
            text[side].append(torch.nn.functional.normalize(out.text_embeds.to(_F64), dim=-1))
            image[side].append(torch.nn.functional.normalize(out.image_embeds.to(_F64), dim=-1))
    return PairedEmbeddings(
        {s: torch.cat(v) for s, v in text.items()}, {s: torch.cat(v) for s, v in image.items()}, torch.cat(heldout)
    )


def retrieval_accuracy(text: torch.Tensor, image: torch.Tensor) -> dict[str, float]:
    """Zero-shot retrieval among ``n`` pairs: the fraction of images whose own caption is their most
    similar text, and of texts whose own image is their most similar image."""
    similarity = image @ text.T
    truth = torch.arange(len(text))
    return {
        "image_to_text": float((similarity.argmax(1) == truth).double().mean()),
        "text_to_image": float((similarity.argmax(0) == truth).double().mean()),
    }


# -- the joint map ---------------------------------------------------------------------------------------
def estimate_joint_map(embeddings: PairedEmbeddings, schema: ModelSchema) -> tuple[ResidualRotation, dict]:
    """U with B's embeddings·U ≈ A's, from the fit pairs' cross moment (texts and images together):
    the Procrustes solution over O(p), or over the maps fixing the mean axis where a LayerNorm sits in
    the joint space (docs/design.md §11.3)."""
    moments = Moments.zeros(schema.hidden_size, quad_dtype=_F64, product_dtype=_F64)
    moments.update(embeddings.rows("a", False), embeddings.rows("b", False))
    mode = "rotation" if schema.residual.exact == "mean_fixing" else "orthogonal"
    transform, log = estimate_residual_map(moments, mode=mode, return_log=True)
    return transform, log


def joint_decision(estimate: ResidualRotation, embeddings: PairedEmbeddings, config: RaotConfig) -> GateDecision:
    """The joint map against the identity on the held-out pairs: per coordinate, the cosine of A's
    embeddings with B's under U against without it (§5.1, the decision rule of §5.2); then a map near
    the identity (affinity ≥ the sibling threshold, §5.4) keeps the identity."""
    sums = PairedDiagonal.zeros(estimate.matrix.shape[0])
    a, b = embeddings.rows("a", True), embeddings.rows("b", True)
    sums.update(a, b, b @ estimate.matrix)
    gains, identity = residual_gains(sums)
    gate = config.gate
    decision = decide_one(
        "joint", None, gains, identity, z=gate.z, min_gain=gate.min_gain, heldout_tokens=int(a.shape[0]),
        min_tokens=gate.min_heldout_tokens, is_identity=False, enabled=gate.enabled, description=estimate.describe(),
    )  # fmt: skip
    _, _, affinity, _ = identity_affinity(estimate)
    if decision.applied and gate.sibling_check and affinity >= SIBLING_AFFINITY:
        why = f"siblings: the joint map is near the identity (affinity {affinity:.3f})"
        decision = dataclasses.replace(decision, applied=False, reason=why, status=Status.SIBLINGS)
    return decision


# -- the merge -------------------------------------------------------------------------------------------
@register_two_tower_merger
class DualEncoderMerger:
    """Aligns and merges two two-tower models (docs/design.md §11); options are :class:`RaotConfig`'s.
    ``processor``: A's processor with a ``tokenizer`` and an ``image_processor``. The calibration data
    pairs images with captions: a dataset with ``image`` and ``text`` columns, or a folder of images
    with a ``metadata.jsonl`` / ``metadata.csv`` giving each file's ``text``."""

    def __init__(self, model_a, model_b, *, config: RaotConfig | None = None, processor=None, base_model=None,
                 sources: tuple[str, str] = ("A", "B")):  # fmt: skip
        from raot_hf.io.loading import check_compatible

        config = config or RaotConfig()
        if model_a.config.model_type != model_b.config.model_type:
            raise RaotError(
                f"A is a {model_a.config.model_type} model and B a {model_b.config.model_type} model; "
                "merge two checkpoints of one architecture."
            )
        self.spec = get_dual_encoder(model_a.config.model_type)
        for tower in self.spec.towers:  # each tower's shapes, as for any model of its family
            config_a, config_b = getattr(model_a, tower.prefix).config, getattr(model_b, tower.prefix).config
            check_compatible(config_a, config_b)
        dims = [getattr(m.config, "projection_dim", None) for m in (model_a, model_b)]
        if dims[0] != dims[1]:
            raise RaotError(f"A and B differ in projection_dim ({dims[0]} vs {dims[1]}); merge two of one shape.")
        if (
            processor is None
            or getattr(processor, "tokenizer", None) is None
            or not hasattr(processor, "image_processor")
        ):
            raise RaotError(
                "a two-tower merge needs A's processor with a tokenizer and an image processor; pass processor="
            )
        self.model_a, self.model_b = model_a.eval(), model_b.eval()
        self.config, self.processor, self.base_model, self.sources = config, processor, base_model, sources
        self.merged = False

    @classmethod
    def from_models(cls, model_a, model_b, *, preprocessor=None, config=None, base_model=None, **options):
        config = (config or RaotConfig()).replace(**options) if options else (config or RaotConfig())
        return cls(model_a, model_b, config=config, processor=preprocessor, base_model=base_model)

    @classmethod
    def from_pretrained(cls, a, b, *, config: RaotConfig | None = None, base=None, allow_pickle: bool = False,
                        **options):  # fmt: skip
        """Load A, B (and a base) with their own classes and A's processor (local directories or Hub ids)."""
        import transformers

        config = (config or RaotConfig()).replace(**options) if options else (config or RaotConfig())
        load = dict(dtype="auto", use_safetensors=None if allow_pickle else True)
        models = [transformers.AutoModel.from_pretrained(str(p), **load) for p in (a, b)]
        base_model = transformers.AutoModel.from_pretrained(str(base), **load) if base is not None else None
        processor = transformers.AutoProcessor.from_pretrained(str(a))
        return cls(*models, config=config, processor=processor, base_model=base_model, sources=(str(a), str(b)))

    def merge(self, calibration=None) -> MergeResult:
        """Estimate and gate the joint map, apply it to B, merge each tower as its family merges, merge
        the scalars; return the merged two-tower model (A's object) and the report."""
        if self.merged:
            raise RaotError("this merger has merged already (the models changed); make a new one")
        self.merged = True
        cfg = self.config
        aligning = cfg.alignment != "none" and bool(cfg.scope)
        data = _paired_dataset(calibration, cfg.calibration, required=aligning)
        sample = cfg.calibration
        models = {"a": self.model_a, "b": self.model_b}
        before = joint_embeddings(models, self.processor, data, sample) if data is not None else None
        schema = joint_schema(self.spec, self.model_a)
        decisions, applied = [], []
        if aligning:
            estimate, log = estimate_joint_map(before, schema)
            decision = joint_decision(estimate, before, cfg)
            decisions.append(decision)
            if decision.applied:
                if schema.folds:  # both folded alike: the merge is between like parameters (§3.3)
                    fold_model(self.model_a, schema)
                transform_model(self.model_b, schema, estimate)
                applied.append(estimate)
        towers_a, towers_b = tower_models(self.spec, self.model_a), tower_models(self.spec, self.model_b)
        towers_base = tower_models(self.spec, self.base_model) if self.base_model is not None else {}
        reports, tower_results = {}, {}
        for modality, tower_a in towers_a.items():
            part = self.processor.tokenizer if modality == "text" else self.processor.image_processor
            merger = RaotMerger.from_models(tower_a, towers_b[modality], preprocessor=part, config=cfg,
                                            base_model=towers_base.get(modality))  # fmt: skip
            tower_results[modality] = merger.merge(calibration=calibration)  # the same sample, drawn alike
            reports[modality] = tower_results[modality].report
        scalars = _merge_scalars(self.spec, self.model_a, self.model_b, cfg)
        zero_shot = None  # without paired data there is nothing to retrieve
        if data is not None:
            after = joint_embeddings({"m": self.model_a}, self.processor, data, sample)
            zero_shot = {"pairs": int(before.heldout.sum())}
            for side, embeddings in (("a", before), ("b", before), ("merge", after)):
                key = "m" if side == "merge" else side
                keep = embeddings.heldout
                zero_shot[side] = retrieval_accuracy(embeddings.text[key][keep], embeddings.image[key][keep])
        alignment = _alignment(decisions, applied, tower_results, schema)
        report = _report(self, alignment, decisions, reports, scalars, zero_shot, data)
        result = MergeResult(self.model_a, report, alignment, self.processor, self.sources[0])
        result.more_transforms = {
            f"raot_transform_{m}.safetensors": r.alignment.applied for m, r in tower_results.items()
        }
        return result


def _paired_dataset(calibration, config: CalibrationConfig, *, required: bool):
    """The paired sample: an in-memory dataset, a path (dataset files, or a folder of images with
    captions in ``metadata.jsonl`` / ``metadata.csv``) or the config's own source; refused unless it
    holds both an image and a text column. None when there is none and the merge reads no data."""
    from raot_hf.calibration.sources import check_column

    if calibration is None and config.source is None:
        if not required:
            return None
        raise RaotError("a two-tower merge needs paired images and captions; pass calibration=... (or --calibration)")
    if isinstance(calibration, (str, Path)):
        config = CalibrationConfig.from_dict({**config.to_dict(), "source": str(calibration)})
        calibration = None
    dataset = load_calibration_dataset(calibration if calibration is not None else config, config=config)
    for modality in ("image", "text"):
        check_column(dataset, None, modality, model_label="a two-tower model (paired images and captions)")
    return dataset


def _merge_scalars(spec, model_a, model_b, config: RaotConfig) -> dict[str, float]:
    """The parameters outside both towers — the logit scale (and SigLIP's bias) — as the parents'
    weighted mean, whatever the rule: a temperature and an offset of the cosines, not a task vector to
    elect or drop entries of (docs/design.md §11.4). Returns their merged values."""
    from raot_hf.stages.members import model_weights

    weights = model_weights(config, 2)
    out = {}
    for name in spec.scalars:
        a, b = model_a.get_parameter(name), model_b.get_parameter(name)
        merged = weights[0] * a.detach().double() + weights[1] * b.detach().double()
        with torch.no_grad():
            a.copy_(merged.to(a.dtype))
        out[name] = a.detach().double().tolist()
    return out


def _alignment(decisions: list, applied: list, towers: dict, schema: ModelSchema) -> Alignment:
    """One alignment for the two-tower model: the joint map's decision and every tower's (named by
    tower), the joint map as the applied transform; its verdict from all of them."""
    rows = list(decisions)
    for modality, result in towers.items():
        for d in result.alignment.decisions:
            rows.append(dataclasses.replace(d, transform=f"{modality} {d.transform}"))
    applied_count, estimates = sum(d.applied for d in rows), len(rows)
    why = "; ".join(f"{m} tower: {r.alignment.verdict}" for m, r in towers.items())
    exact = all(r.alignment.exact for r in towers.values())
    if not estimates:
        verdict = BasisVerdict(Verdict.NOT_REQUESTED)
    elif applied_count:
        verdict = BasisVerdict(Verdict.DIFFERS_IN_BASIS, why=why, applied=applied_count, estimates=estimates)
    else:
        verdict = BasisVerdict(Verdict.SHARES_BASIS, why=why, applied=0, estimates=estimates)
    return Alignment(rows, TransformSequence(list(applied)), exact, {}, verdict)


def _report(merger, alignment, joint, towers: dict, scalars: dict, zero_shot: dict, data) -> MergeReport:
    """The two-tower merge's report: A and B, B's alignment (the joint map's decision and every
    tower's, named by tower, with the towers' checks), the settings, and the towers' own reports, the
    scalars and the zero-shot check in its :class:`~raot_hf.outputs.record.TowersRecord`."""
    from raot_hf.outputs.card import alignment_summary
    from raot_hf.outputs.record import AlignmentRecord, CheckpointRecord, ModelRecord, TowersRecord
    from raot_hf.stages.provenance import transform_file

    checks = tuple(
        dataclasses.replace(c, name=f"{m} tower: {c.name}")
        for m, r in towers.items() for _, a in r.alignments for c in a.checks
    )  # fmt: skip
    text = towers.get("text", next(iter(towers.values())))
    first = text.alignments[0][1] if text.alignments else None
    record = AlignmentRecord(
        tuple(alignment.decisions), alignment.shares_basis, alignment.verdict, alignment_summary(alignment.decisions),
        transform_file(2) if len(alignment.applied) else None,
        tuple(t.describe() for t in alignment.applied.transforms), alignment.exact, checks,
        calibration=first.calibration if first is not None else None,
    )  # fmt: skip
    architecture = type(merger.model_a).__name__
    models = (
        ModelRecord(1, "reference", CheckpointRecord(merger.sources[0], architecture=architecture)),
        ModelRecord(2, "aligned" if joint or text.alignments else "merged",
                    CheckpointRecord(merger.sources[1], architecture=architecture),
                    record if joint or text.alignments else None),
    )  # fmt: skip
    two_towers = TowersRecord(
        merger.spec.name, joint[0] if joint else None, "mean_fixing" if merger.spec.joint.norm else "orthogonal",
        dict(towers), scalars, zero_shot, 0 if data is None else len(data),
    )  # fmt: skip
    return MergeReport(
        models, merger.config, "in memory", text.merge, merger.model_a.config.model_type,
        command=text.command, two_towers=two_towers,
    )  # fmt: skip
