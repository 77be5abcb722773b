"""Every symmetry transform leaves the function unchanged (docs/design.md §3)."""

import json

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file as safetensors_save

from raot_hf import RaotError, schema_for, scramble
from raot_hf.symmetry import (
    HeadAlignment,
    MLPPermutation,
    ResidualRotation,
    Transform,
    TransformSequence,
    fold_model,
    is_exact,
    mean_fixing,
    model_state,
    random_group_element,
    random_orthogonal,
    transform_model,
)
from raot_hf.testing import architectures, clone, example_inputs, output_deviation, tiny_architecture, tiny_model

# every head of every encoder (the decoders' cases are in test_decoders.py)
CASES = [(t, head) for t in architectures(decoders=False, variants=True) for head in tiny_architecture(t).heads]
KINDS = [("mlp",), ("heads",), ("residual",), ("rescale",), ("mlp", "heads", "residual", "rescale")]


def _stream_map(schema, transform):
    actions = transform.actions(schema)
    return actions["residual"].dense(schema.hidden_size) if "residual" in actions else None


def _check(model, transform, *, relative=False):
    schema = schema_for(model)
    moved = transform_model(clone(model), schema, transform)
    x = example_inputs(model)
    return output_deviation(model, moved, x, stream_map=_stream_map(schema, transform), relative=relative), moved


@pytest.mark.usefixtures("float64_deberta_layernorm")
@pytest.mark.parametrize("model_type,head", CASES)
@pytest.mark.parametrize("kinds", KINDS, ids="+".join)
def test_exact_symmetry_float64(model_type, head, kinds):
    model = tiny_model(model_type, head)
    transform = random_group_element(schema_for(model), seed=3, kinds=kinds)
    dev, moved = _check(model, transform)
    assert dev <= 1e-9, f"{model_type}/{head} {kinds}: deviation {dev:.3g}"
    # The transform must actually move weights, or the check above proves nothing.
    changed = any(not torch.equal(p, q) for p, q in zip(model.parameters(), moved.parameters(), strict=True))
    assert changed


@pytest.mark.parametrize("model_type,head", [("bert", "sequence"), ("deberta", "sequence"), ("vit", "image")])
def test_exact_symmetry_float32(model_type, head):
    model = tiny_model(model_type, head, dtype=torch.float32)
    transform = random_group_element(schema_for(model), seed=5, kinds=("mlp", "heads", "residual", "rescale"))
    dev, _ = _check(model, transform, relative=True)
    assert dev <= 1e-4


@pytest.mark.usefixtures("float64_deberta_layernorm")
@pytest.mark.parametrize(
    "overrides",
    [
        {"share_att_key": False},
        {"share_att_key": False, "pos_att_type": ["c2p"]},
        {"share_att_key": True, "pos_att_type": ["p2c"]},
        {"relative_attention": False, "position_biased_input": True},
        {"norm_rel_ebd": "none"},
    ],
)
def test_deberta_v2_relative_paths(overrides):
    model = tiny_model("deberta-v2", "sequence", **overrides)
    schema = schema_for(model)
    if overrides.get("share_att_key") is False and model.config.relative_attention:
        roles = {m.role for m in schema.qk_space(0).members}
        assert "pos" in roles  # pos_key_proj / pos_query_proj are in head space
    transform = random_group_element(schema, seed=7, kinds=("mlp", "heads", "residual", "rescale"))
    dev, _ = _check(model, transform)
    assert dev <= 1e-9


@pytest.mark.usefixtures("float64_deberta_layernorm")
@pytest.mark.parametrize("pos_att_type", [["c2p"], ["p2c"], ["c2p", "p2c"]])
def test_deberta_v1_fused_in_proj(pos_att_type):
    model = tiny_model("deberta", "sequence", pos_att_type=pos_att_type)
    transform = random_group_element(schema_for(model), seed=11, kinds=("heads", "rescale"))
    dev, moved = _check(model, transform)
    assert dev <= 1e-9
    # q/k/v rows are interleaved per head: a head alignment moves every third block of in_proj.
    w0 = model.deberta.encoder.layer[0].attention.self.in_proj.weight
    w1 = moved.deberta.encoder.layer[0].attention.self.in_proj.weight
    assert not torch.equal(w0, w1)


def test_wrong_in_proj_layout_breaks_equivalence(float64_deberta_layernorm):
    """The interleaved layout is load-bearing: treating in_proj as [q; k; v] is not a symmetry."""
    from raot_hf.adapters.schema import Member

    model = tiny_model("deberta", "sequence")
    schema = schema_for(model)
    d, name = schema.hidden_size, "deberta.encoder.layer.0.attention.self.in_proj.weight"
    for space in (schema.qk_space(0), schema.vo_space(0)):
        for i, m in enumerate(space.members):
            if m.name == name:
                offset = {"q": 0, "k": d, "v": 2 * d}[m.role]
                space.members[i] = Member(m.name, m.axis, m.covariant, m.role, tuple(range(offset, offset + d)))
    transform = random_group_element(schema, seed=1, kinds=("heads",))
    moved = transform_model(clone(model), schema, transform)
    assert output_deviation(model, moved, example_inputs(model)) > 1e-6


@pytest.mark.parametrize("head", ["base", "image"])
def test_vit_residual_rotation(head):
    model = tiny_model("vit", head)
    schema = schema_for(model)
    g = torch.Generator().manual_seed(0)
    rot = ResidualRotation(mean_fixing(random_orthogonal(schema.hidden_size - 1, g)))
    if head == "image":
        assert schema.residual.exact == "mean_fixing" and is_exact(rot, schema)
        dev, _ = _check(model, rot)
        assert dev <= 1e-9
    else:
        # The base model's output is the final LayerNorm's: it cannot be folded, so a
        # rotation is approximate there and the schema says so.
        assert schema.residual.exact == "permutation" and not is_exact(rot, schema)


def test_post_ln_rotation_is_flagged_approximate():
    model = tiny_model("bert", "sequence")
    schema = schema_for(model)
    g = torch.Generator().manual_seed(0)
    rot = ResidualRotation(mean_fixing(random_orthogonal(schema.hidden_size - 1, g)))
    assert not is_exact(rot, schema)
    dev, _ = _check(model, rot)
    assert dev > 1e-6  # the approximation is real, and measured rather than hidden


def test_fold_is_exact_and_idempotent():
    model = tiny_model("vit", "image")
    schema = schema_for(model)
    folded = fold_model(clone(model), schema)
    x = example_inputs(model)
    assert output_deviation(model, folded, x) <= 1e-9
    again = fold_model(clone(folded), schema)
    assert all(torch.equal(p, q) for p, q in zip(folded.parameters(), again.parameters(), strict=True))


def test_transform_json_round_trip_and_composition():
    model = tiny_model("vit", "image")
    schema = schema_for(model)
    t1 = random_group_element(schema, seed=1, kinds=("mlp", "heads", "residual", "rescale"))
    t2 = random_group_element(schema, seed=2)
    composed = t1.then(t2)
    restored = Transform.from_dict(json.loads(json.dumps(composed.to_dict())))
    a = transform_model(clone(model), schema, composed)
    b = transform_model(clone(model), schema, restored)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    sequential = transform_model(transform_model(clone(model), schema, t1), schema, t2)
    assert max((p - q).abs().max() for p, q in zip(a.parameters(), sequential.parameters(), strict=True)) < 1e-12
    assert output_deviation(model, a, example_inputs(model)) <= 1e-9


def test_inverse_undoes_transform():
    model = tiny_model("bert", "sequence")
    schema = schema_for(model)
    perm = torch.randperm(schema.intermediate_size, generator=torch.Generator().manual_seed(0))
    t = MLPPermutation(0, perm)
    inv = MLPPermutation(0, torch.argsort(perm))
    back = transform_model(transform_model(clone(model), schema, t), schema, inv)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), back.parameters(), strict=True))


def test_scramble_in_place_and_save_round_trip(tmp_path):
    model = tiny_model("bert", "sequence")
    scrambled = clone(model)
    transform = scramble(scrambled, seed=4)
    assert isinstance(transform, TransformSequence) and len(transform) > 0
    x = example_inputs(model)
    assert output_deviation(model, scrambled, x) <= 1e-9
    scrambled.save_pretrained(tmp_path / "s")
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "s", dtype=torch.float64)
    reloaded.eval()
    assert output_deviation(scrambled, reloaded, x) == 0.0


def test_vit_save_round_trip_after_rotation(tmp_path):
    model = tiny_model("vit", "image")
    scrambled = clone(model)
    scramble(scrambled, seed=9)
    scrambled.save_pretrained(tmp_path / "v")
    reloaded = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "v", dtype=torch.float64)
    x = example_inputs(model)
    assert output_deviation(scrambled, reloaded.eval(), x) == 0.0
    assert output_deviation(model, reloaded, x) <= 1e-9


def test_unsupported_model_type_names_it():
    cfg = transformers.OPTConfig(hidden_size=16, num_attention_heads=4, num_hidden_layers=1, ffn_dim=32, vocab_size=30)
    with pytest.raises(RaotError, match=r"'opt'.*supported: .*bert"):
        schema_for(transformers.OPTModel(cfg))


def test_unsupported_head_names_it():
    model = transformers.BertForMultipleChoice(
        transformers.BertConfig(hidden_size=16, num_attention_heads=4, num_hidden_layers=1, intermediate_size=8)
    )
    with pytest.raises(RaotError, match="BertForMultipleChoice is not supported"):
        schema_for(model)


def test_invalid_transforms_are_refused():
    schema = schema_for(tiny_model("bert", "sequence"))
    with pytest.raises(RaotError, match="permutation"):
        MLPPermutation(0, [0, 0, 1]).actions(schema)
    with pytest.raises(RaotError, match="mean axis"):
        ResidualRotation(torch.eye(schema.hidden_size).flip(0) * -1).actions(schema)
    with pytest.raises(RaotError, match="shape"):
        HeadAlignment(0, torch.arange(schema.num_heads), torch.zeros(1, 2, 2), torch.zeros(1, 2, 2)).actions(schema)
    # the orthogonality check runs once per matrix, and again once the matrix is changed in place
    rotation = ResidualRotation(torch.eye(schema.hidden_size))
    rotation.actions(schema)
    rotation.matrix[0, 0] = 2.0
    with pytest.raises(RaotError, match="orthogonal"):
        rotation.actions(schema)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model_type=st.sampled_from(["bert", "roberta", "deberta-v2", "vit"]),
    num_heads=st.integers(1, 4),
    head_size=st.integers(1, 5),
    intermediate=st.integers(1, 20),
    layers=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_symmetry_property(model_type, num_heads, head_size, intermediate, layers, seed):
    d = num_heads * head_size
    if d < 2:
        d, head_size = 2 * num_heads, 2
    model = tiny_model(
        model_type,
        "sequence" if model_type != "vit" else "image",
        seed=seed,
        hidden_size=d,
        num_heads=num_heads,
        num_layers=layers,
        intermediate_size=intermediate,
    )
    transform = random_group_element(schema_for(model), seed=seed, kinds=("mlp", "heads", "residual", "rescale"))
    dev, _ = _check(model, transform)
    assert dev <= 1e-9


@pytest.mark.parametrize("model_type,head", [("bert", "sequence"), ("vit", "image")])
def test_transform_file_round_trip_reapplies_exactly(tmp_path, model_type, head):
    """raot_transform.safetensors holds every transform bit-exact: applying the loaded copy to
    B gives the same weights as applying the original."""
    from raot_hf.symmetry import HeadRescale, TransformSequence, load_transform, save_transform

    model = tiny_model(model_type, head, seed=2)
    schema = schema_for(model)
    g = random_group_element(schema, seed=9)
    rescale = HeadRescale(0, torch.rand(schema.num_heads) + 0.5, torch.rand(schema.num_heads) + 0.5)
    g = TransformSequence([*g.transforms, rescale])
    save_transform(g, tmp_path / "t.safetensors")
    loaded = load_transform(tmp_path / "t.safetensors")
    assert [type(t) for t in loaded.transforms] == [type(t) for t in g.transforms]
    one, two = clone(model), clone(model)
    transform_model(one, schema, g)
    transform_model(two, schema, loaded)
    for (name, x), (_, y) in zip(model_state(one).items(), model_state(two).items(), strict=True):
        assert torch.equal(x, y), name
    with pytest.raises(RaotError, match="not a raot_hf transform file"):
        safetensors_save({"x": torch.zeros(1)}, tmp_path / "plain.safetensors")
        load_transform(tmp_path / "plain.safetensors")


@pytest.mark.parametrize("n", [4, 96, 320])
def test_composing_with_a_diagonal_action_equals_the_dense_product(n):
    """A head rescale composed with a head alignment scales rows or columns instead of an n³
    product; the numbers must be the dense product's, bit for bit (zeros and signs included)."""
    from raot_hf.symmetry.transforms import SpaceAction

    g = torch.Generator().manual_seed(n)
    dense = torch.randn(n, n, dtype=torch.float64, generator=g)
    dense[0] = 0.0
    scale = torch.randn(n, dtype=torch.float64, generator=g)
    dense_diagonal = SpaceAction(matrix=torch.diag(scale), orthogonal=False, contra=torch.diag(1 / scale))
    rotation = SpaceAction(matrix=dense, orthogonal=True)
    pairs = [(rotation, diagonal) for diagonal in (dense_diagonal, SpaceAction(diagonal=scale, orthogonal=False))]
    for first, second in pairs + [(second, first) for first, second in pairs]:
        composed = first.then(second, n)
        assert torch.equal(composed.matrix, first.dense(n) @ second.dense(n))
        assert torch.equal(composed.contra, first.inverse_transpose().dense(n) @ second.inverse_transpose().dense(n))
    assert torch.equal(rotation.then(rotation, n).matrix, dense @ dense)


@pytest.mark.parametrize("heads,h", [(3, 4), (9, 16)])
def test_head_block_contraction_equals_the_dense_contraction(heads, h):
    """A head map (and a head map then a head rescale) is applied block by block and a rescale entry
    by entry; both must give the dense float64 contraction's numbers (to its own round-off)."""
    from raot_hf.adapters.schema import Member
    from raot_hf.symmetry.apply import _contract
    from raot_hf.symmetry.transforms import SpaceAction, head_action

    g = torch.Generator().manual_seed(heads * h)
    perm = torch.randperm(heads, generator=g)
    blocks = torch.linalg.qr(torch.randn(heads, h, h, dtype=torch.float64, generator=g)).Q
    scale = torch.rand(heads * h, dtype=torch.float64, generator=g) + 0.5
    rescale = SpaceAction(diagonal=scale, orthogonal=False)
    heads_action = head_action(perm, blocks)
    composed = heads_action.then(rescale, heads * h)
    assert composed.blocks is not None and composed.contra_blocks is not None
    weight = torch.randn(5, heads * h, 7, generator=g)
    for action in (heads_action, rescale, composed, composed.inverse_transpose()):
        for axis in (1,):
            member = Member(name="w", role="weight", axis=axis, covariant=True)
            got = _contract(weight, member, action)
            dense = (weight.double().movedim(axis, -1) @ action.dense(heads * h)).movedim(-1, axis).float()
            assert torch.allclose(got, dense, rtol=0, atol=1e-6)
            assert not torch.allclose(got, weight, atol=1e-3)  # it did act


def test_head_alignment_actions_follow_its_tensors_and_skip_the_stream():
    """A head alignment's actions are made once, but an in-place change of its maps is seen; asking
    for the residual action does not make the head maps at all."""
    model = tiny_model("llama", "causal", seed=0)
    schema = schema_for(model)
    H, h = schema.num_heads, schema.head_size
    t = HeadAlignment(0, torch.arange(H), torch.eye(h).repeat(H, 1, 1), torch.eye(h).repeat(H, 1, 1))
    assert t.space_action(schema, "residual") is None and "_made" not in t.__dict__
    qk = schema.qk_space(0).name
    assert torch.equal(t.actions(schema)[qk].dense(H * h), torch.eye(H * h, dtype=torch.float64))
    t.qk.neg_()  # −I in every head: a half turn of each rotary pair, still exact under RoPE
    assert not torch.equal(t.actions(schema)[qk].dense(H * h), torch.eye(H * h, dtype=torch.float64))


def test_load_state_takes_new_tensors_and_copies_other_models_parameters():
    """A model in memory takes a newly computed tensor (nothing is written into the loaded
    parameter's pages), contiguous whatever the value's layout; a value that is another model's
    parameter (``keep``) is copied, so no two models share memory."""
    from raot_hf.symmetry import load_state, storage_of

    a, b = tiny_model("bert", "sequence", seed=0), tiny_model("bert", "sequence", seed=1)
    name = "bert.encoder.layer.0.attention.self.query.weight"
    fresh = torch.randn_like(dict(a.named_parameters())[name]).T.contiguous().T  # a transposed layout
    other = dict(b.named_parameters())["bert.encoder.layer.0.attention.self.key.weight"]
    keep = storage_of(b.parameters())
    load_state(a, {name: fresh}, keep=keep)
    param = dict(a.named_parameters())[name]
    assert torch.equal(param, fresh) and param.is_contiguous()
    load_state(a, {name: other.detach()}, keep=keep)
    param = dict(a.named_parameters())[name]
    assert torch.equal(param, other) and param.untyped_storage().data_ptr() not in keep
    value = torch.randn_like(param)
    load_state(a, {name: value}, keep=keep)
    assert dict(a.named_parameters())[name].untyped_storage().data_ptr() == value.untyped_storage().data_ptr()


def test_a_taken_over_checkpoint_parameter_keeps_its_values_for_earlier_readers(tmp_path):
    """A loaded parameter that takes a new tensor hands its memory-mapped pages back; a tensor that
    still reads the old storage reads the checkpoint's values again, not zeros."""
    from raot_hf.io.offload import mapped_file_ranges
    from raot_hf.symmetry import load_state

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=2048
    )
    transformers.BertModel(config).save_pretrained(tmp_path / "m")
    model = transformers.BertModel.from_pretrained(tmp_path / "m")
    name = "encoder.layer.0.intermediate.dense.weight"  # 512 KiB: whole pages of the mapped file
    old = dict(model.named_parameters())[name].detach()
    original = old.clone()
    start = old.untyped_storage().data_ptr()
    assert any(lo <= start < hi for lo, hi in mapped_file_ranges())  # what this test is about
    load_state(model, {name: torch.zeros_like(old)}, keep=set())
    assert torch.equal(dict(model.named_parameters())[name], torch.zeros_like(old))
    assert torch.equal(old, original)


def test_the_norm_deviation_weighs_every_real_entry_not_the_largest():
    """‖Δ‖ / ‖r‖ over the real tokens (padding ignored). With one massive entry (a massive-activation
    token) at 100× the typical size, the max form max|Δ| / max|r| divides a typical error by the
    massive entry; the norm form divides it by the norm of every real entry, so it reads the error
    on the ordinary tokens several times larger."""
    from raot_hf.symmetry.equivalence import compare_outputs

    g = torch.Generator().manual_seed(0)
    r = torch.randn(2, 32, 64, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 20:] = 0
    c = r + 1e-2 * torch.randn(r.shape, generator=g, dtype=torch.float64)
    c[1, 20:] += 1e3  # padding: ignored
    real = mask.bool()
    expected = float((c - r)[real].norm() / r[real].norm())
    assert compare_outputs({"x": r}, {"x": c}, mask, relative=True, form="norm") == pytest.approx(expected, rel=1e-12)
    r[0, 0, 0] = c[0, 0, 0] = 100.0
    by_max = compare_outputs({"x": r}, {"x": c}, mask, relative=True)
    by_norm = compare_outputs({"x": r}, {"x": c}, mask, relative=True, form="norm")
    assert by_norm == pytest.approx(float((c - r)[real].norm() / r[real].norm()), rel=1e-12)
    assert 5 * by_max < by_norm
