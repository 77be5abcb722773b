"""The families beyond BERT, ViT, GPT-2 and Llama, each under the group its forward equations leave
(docs/design.md §9).

Three kinds of test. **Restrictions**: where a family's group is smaller than Llama's, the larger
group's transform changes the function (so the restriction is necessary) while the smaller one's
does not. **A permutation written from the equations**: the residual stream and the MLP units
permuted on the parameters named as the modeling code names them — tables below, written from the
layouts, not read from the family specs — keeps the function, and merging it with A gives A back
under both moment precisions. **Siblings**: two fine-tunes of one base share a basis.

The recovery of a scramble over each family's whole group (d = 32, 64, 128, both precisions,
massive activations and near-twin units) runs in the shared per-architecture tests
(``tests/test_recovery.py``), as every other per-architecture test does.
"""

import re

import pytest
import torch

from raot_hf import RaotError, RaotMerger, schema_for
from raot_hf.adapters import is_decoder
from raot_hf.gate import Verdict
from raot_hf.symmetry import (
    HeadAlignment,
    HeadRescale,
    ResidualRotation,
    ResidualSignedPermutation,
    random_orthogonal,
    rope_blocks,
    transform_model,
    turn_blocks,
)
from raot_hf.testing import (
    architectures,
    clone,
    exact_rmsnorm,
    example_inputs,
    fine_tune,
    output_deviation,
    tiny_architecture,
    tiny_data,
    tiny_model,
    tiny_text_dataset,
    tiny_tokenizer,
    trained_like,
)

VOCAB = 100
PRECISIONS = ["float32", "bfloat16"]


def _deviation(model, moved, stream=None, relative=False):
    with exact_rmsnorm():  # the RMSNorms' float32 cast aside: the symmetry itself is exact
        return output_deviation(model, moved, example_inputs(model), stream, relative=relative)


def _eye(schema, n=None):
    h = schema.head_size
    return torch.eye(h, dtype=torch.float64).expand(n or schema.num_heads, h, h).clone()


# --------------------------------------------------------------------------------- restrictions
@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "olmo2"])
def test_qk_norms_leave_turns_of_rotary_pairs_and_no_qk_scales(model_type):
    """A norm of each query and key head before RoPE (§9.1): Llama's per-pair rotation by a generic
    angle and a Q/K scale change the function; a half turn of every pair (a quarter turn where each
    head has its own norm weights, OLMo 2) keeps it, and is all the schema admits."""
    model = tiny_model(model_type, "causal")
    schema = schema_for(model)
    H, kv, h, G = schema.num_heads, schema.kv_heads, schema.head_size, schema.num_heads // schema.kv_heads
    assert schema.qk_turns == (4 if model_type == "olmo2" else 2) and not schema.qk_scales
    g = torch.Generator().manual_seed(0)
    angles = (0.3 + torch.rand(kv, h // 2, generator=g, dtype=torch.float64)).repeat_interleave(G, 0)
    generic = HeadAlignment(0, torch.arange(H), rope_blocks(angles), _eye(schema))
    with pytest.raises(RaotError, match="turn by multiples"):
        generic.actions(schema)
    schema.qk_turns = None  # bypass the check: Llama's map is then not a symmetry
    assert _deviation(model, transform_model(clone(model), schema, generic)) > 1e-3
    schema.qk_turns, schema.qk_scales = (4 if model_type == "olmo2" else 2), True
    # q·s, k/s: the norms divide the scales out, but not from their ε (and, over the whole
    # projection, not without moving the other heads' norm): the function moves past exactness
    scale = HeadRescale(0, torch.full((H, h // 2), 10.0, dtype=torch.float64), torch.ones(H, dtype=torch.float64))
    assert _deviation(model, transform_model(clone(model), schema, scale)) > 1e-7
    schema.qk_scales = False
    with pytest.raises(RaotError, match="absorbs their scales"):
        scale.actions(schema)
    turns = torch.randint(0, schema.qk_turns, (kv, h // 2), generator=g).repeat_interleave(G, 0)
    blocks = turn_blocks(turns, schema.qk_turns)
    assert turns.any() and torch.equal(blocks.abs().sum(-1), torch.ones_like(blocks[..., 0]))  # signed permutations
    allowed = HeadAlignment(0, torch.arange(H), blocks, _eye(schema))
    assert _deviation(model, transform_model(clone(model), schema, allowed)) <= 1e-9


def test_a_quarter_turn_needs_per_head_norm_weights():
    """Qwen3's norm weight is shared by every head: a quarter turn of one pair in one KV head
    changes the function (OLMo 2's per-head weights move with it instead, above)."""
    model = tiny_model("qwen3", "causal")
    schema = schema_for(model)
    H, kv, h = schema.num_heads, schema.kv_heads, schema.head_size
    turns = torch.zeros(kv, h // 2, dtype=torch.long)
    turns[0, 0] = 1
    quarter = HeadAlignment(0, torch.arange(H), turn_blocks(turns, 4).repeat_interleave(H // kv, 0), _eye(schema))
    schema.qk_turns = 4  # bypass: what OLMo 2's schema would admit
    assert _deviation(model, transform_model(clone(model), schema, quarter)) > 1e-3


@pytest.mark.parametrize("model_type", ["gemma2", "olmo2"])
def test_norms_on_branch_outputs_leave_signed_permutations_of_the_stream(model_type):
    """A norm on each branch's output (§9.2): a rotation of the stream changes the function even
    untied; a signed permutation keeps it (the norm weights move, the signs pass through)."""
    model = tiny_model(model_type, "causal")
    schema = schema_for(model)
    d = schema.hidden_size
    assert schema.residual.exact == "signed_permutation"
    g = torch.Generator().manual_seed(1)
    rotation = ResidualRotation(random_orthogonal(d, g))
    schema.residual.exact = "orthogonal"  # bypass: what an untied Llama admits
    moved = transform_model(clone(model), schema, rotation)
    assert _deviation(model, moved, rotation.matrix, relative=True) > 1e-3
    schema.residual.exact = "signed_permutation"
    signs = 2.0 * torch.randint(0, 2, (d,), generator=g, dtype=torch.float64) - 1
    signed = ResidualSignedPermutation(torch.randperm(d, generator=g), signs)
    moved = transform_model(clone(model), schema, signed)
    assert _deviation(model, moved) <= 1e-9 and (signs < 0).any()


@pytest.mark.parametrize(("model_type", "overrides"), [("gpt_neox", {}), ("phi3", {"partial": 0.5})])
def test_partial_rotary_heads_split_into_pairs_and_a_free_block(model_type, overrides):
    """A fraction of each head rotates (§9.4): any orthogonal map of the dims that do not rotate
    keeps the function, a map mixing a rotary dim with a free one does not."""
    config = {}
    if "partial" in overrides:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    model = tiny_model(model_type, "causal", hidden_size=64, num_heads=4, **config)
    schema = schema_for(model)
    H, h, r = schema.num_heads, schema.head_size, schema.rotary_dims
    G = H // schema.kv_heads
    assert r == h // 2
    g = torch.Generator().manual_seed(2)
    free = torch.eye(h, dtype=torch.float64).repeat(schema.kv_heads, 1, 1)
    free[:, r:, r:] = torch.stack([random_orthogonal(h - r, g) for _ in range(schema.kv_heads)])
    kept = HeadAlignment(0, torch.arange(H), free.repeat_interleave(G, 0), _eye(schema))
    assert _deviation(model, transform_model(clone(model), schema, kept)) <= 1e-9
    mixing = torch.eye(h, dtype=torch.float64)
    mixing[[0, r]] = mixing[[r, 0]]  # swaps a rotary dim with a free one
    mixed = HeadAlignment(0, torch.arange(H), mixing.expand(H, h, h).clone(), _eye(schema))
    with pytest.raises(RaotError, match="rotary pair"):
        mixed.actions(schema)
    schema.rotary_dims = None  # bypass the check
    schema.qk_structure = "free"
    assert _deviation(model, transform_model(clone(model), schema, mixed)) > 1e-6  # (exact: ≤ 1e-9)


def test_neox_fused_projection_is_interleaved_per_head():
    """GPT-NeoX's query_key_value holds [q_i | k_i | v_i] per head; read as [q | k | v] blocks a
    head map is no symmetry (the layout is load-bearing)."""
    from raot_hf.adapters.schema import Member

    model = tiny_model("gpt_neox", "causal")
    schema = schema_for(model)
    d, name = schema.hidden_size, "gpt_neox.layers.0.attention.query_key_value.weight"
    for space in (schema.qk_space(0), schema.vo_space(0)):
        for i, m in enumerate(space.members):
            if m.name == name:
                offset = {"q": 0, "k": d, "v": 2 * d}[m.role]
                space.members[i] = Member(m.name, m.axis, m.covariant, m.role, tuple(range(offset, offset + d)))
    H = schema.num_heads
    vo = torch.stack([random_orthogonal(schema.head_size, torch.Generator().manual_seed(i)) for i in range(H)])
    moved = transform_model(clone(model), schema, HeadAlignment(0, torch.arange(H), _eye(schema), vo))
    assert _deviation(model, moved) > 1e-6


def test_a_relative_bias_shared_by_the_layers_keeps_heads_in_place():
    """MPNet adds one per-head bias table to every layer's scores (§9.7): a head permutation of one
    layer changes the function and is refused; within-head maps and scales are exact."""
    model = trained_like(tiny_model("mpnet", "sequence"))  # a bias table of unit scale, peaked attention
    schema = schema_for(model)
    H, h = schema.num_heads, schema.head_size
    assert not schema.head_permutation
    perm = torch.roll(torch.arange(H), 1)
    with pytest.raises(RaotError, match="may not be permuted"):
        HeadAlignment(0, perm, _eye(schema), _eye(schema)).actions(schema)
    schema.head_permutation = True
    moved = transform_model(clone(model), schema, HeadAlignment(0, perm, _eye(schema), _eye(schema)))
    assert _deviation(model, moved) > 1e-3
    g = torch.Generator().manual_seed(3)
    maps = [torch.stack([random_orthogonal(h, g) for _ in range(H)]) for _ in range(2)]
    moved = transform_model(clone(model), schema, HeadAlignment(0, torch.arange(H), *maps))
    assert _deviation(model, moved) <= 1e-9


def test_layer_scale_folds_into_its_writer_before_the_stream_rotates():
    """DINOv2's LayerScale λ is a per-channel weight in the stream (§9.8): a rotation with λ left
    in the stream changes the function; with λ folded into the writers first (as a transform does)
    it is exact (the final LayerNorm folds into the classifier, which reads two tokens' normed
    streams side by side). The base model returns the final norm's output: permutations only."""
    import dataclasses

    from raot_hf.symmetry import mean_fixing

    assert schema_for(tiny_model("dinov2", "base")).residual.exact == "permutation"
    model = tiny_model("dinov2", "image")
    schema = schema_for(model)
    assert schema.residual.exact == "mean_fixing"
    assert sum(1 for f in schema.folds if f.writers) == 2 * schema.num_layers
    rotation = ResidualRotation(mean_fixing(random_orthogonal(schema.hidden_size - 1, torch.Generator())))
    assert _deviation(model, transform_model(clone(model), schema, rotation)) <= 1e-9
    without = dataclasses.replace(schema, folds=[f for f in schema.folds if not f.writers])
    assert _deviation(model, transform_model(clone(model), without, rotation)) > 1e-3


def test_gemma_norms_fold_with_their_offset():
    """Gemma's norms scale by 1 + w: a fold moves 1 + w into the readers and leaves w = 0 (the
    weight of a norm that multiplies by 1), exactly."""
    from raot_hf.symmetry import fold_model, is_folded

    model = tiny_model("gemma2", "causal")
    schema = schema_for(model)
    assert schema.folds and all(f.offset == 1.0 and f.identity_weight == 0.0 for f in schema.folds)
    folded = fold_model(clone(model), schema)
    assert is_folded(dict(folded.named_parameters()), schema)
    assert torch.all(folded.model.layers[0].input_layernorm.weight == 0)
    assert _deviation(model, folded) <= 1e-9


def test_electra_with_small_embeddings_starts_the_stream_at_their_projection():
    """ELECTRA's embeddings of size E < d are projected into the stream: the projection is the
    stream's writer there, the tables are left as they are, and the whole group stays exact."""
    from raot_hf.symmetry import random_group_element

    model = tiny_model("electra", "sequence", embedding_size=8, hidden_size=16)
    schema = schema_for(model)
    writers = {m.name for m in schema.residual.members if m.role == "writer"}
    assert "electra.embeddings_project.weight" in writers and not any("word_embeddings" in w for w in writers)
    assert schema.stream_modules[0] == "electra.embeddings_project"
    transform = random_group_element(schema, seed=6)
    assert _deviation(model, transform_model(clone(model), schema, transform)) <= 1e-9


# ------------------------------------------------------------- a permutation from the equations
# Per layout, the parameters a stream permutation and an MLP unit permutation move, as the modeling
# code of transformers names them: (pattern, axis) pairs. A fused MLP input holds a unit's row in
# each of its two blocks. Written from the layouts, not read from the families' specs.
_STREAM, _MLP, _MLP2 = "stream", "mlp", "mlp2"
_LAYOUTS = {
    "llama": {  # Llama, Mistral, Qwen2/3, Gemma 2/3, OLMo 2, Granite, SmolLM3
        "signature": r"self_attn\.q_proj",
        _STREAM: [
            (r"embed_tokens\.weight$", 1),
            (r"self_attn\.[qkv]_proj\.weight$", 1),
            (r"mlp\.(gate|up)_proj\.weight$", 1),
            (r"(lm_head|score)\.weight$", 1),
            (r"(o_proj|down_proj)\.(weight|bias)$", 0),
            (r"(layernorm|model\.norm)\.weight$", 0),
        ],
        _MLP: [(r"mlp\.(gate|up)_proj\.(weight|bias)$", 0), (r"mlp\.down_proj\.weight$", 1)],
    },
    "phi3": {
        "signature": r"self_attn\.qkv_proj",
        _STREAM: [
            (r"embed_tokens\.weight$", 1),
            (r"(qkv_proj|gate_up_proj)\.weight$", 1),
            (r"(lm_head|score)\.weight$", 1),
            (r"(o_proj|down_proj)\.weight$", 0),
            (r"(layernorm|model\.norm)\.weight$", 0),
        ],
        _MLP2: [(r"mlp\.gate_up_proj\.weight$", 0)],
        _MLP: [(r"mlp\.down_proj\.weight$", 1)],
    },
    "gpt_neox": {
        "signature": r"attention\.query_key_value",
        _STREAM: [
            (r"embed_in\.weight$", 1),
            (r"(query_key_value|dense_h_to_4h)\.weight$", 1),
            (r"(lm_head|score)\.weight$", 1),
            (r"(attention\.dense|dense_4h_to_h)\.(weight|bias)$", 0),
            (r"(layernorm|final_layer_norm)\.(weight|bias)$", 0),
        ],
        _MLP: [(r"dense_h_to_4h\.(weight|bias)$", 0), (r"dense_4h_to_h\.weight$", 1)],
    },
    "bert": {  # BERT, RoBERTa, ELECTRA, MPNet
        "signature": r"attention\.(self\.query|attn\.q)\.",
        _STREAM: [
            (r"embeddings\.\w+_embeddings\.weight$", 1),
            (r"attention\.(self\.(query|key|value)|attn\.[qkv])\.weight$", 1),
            (r"intermediate\.dense\.weight$", 1),
            (r"(pooler|classifier)\.dense\.weight$", 1),
            (r"(attention\.output\.dense|attention\.attn\.o|output\.dense)\.(weight|bias)$", 0),
            (r"LayerNorm\.(weight|bias)$", 0),
        ],
        _MLP: [(r"intermediate\.dense\.(weight|bias)$", 0), (r"layer\.\d+\.output\.dense\.weight$", 1)],
    },
    "distilbert": {
        "signature": r"attention\.q_lin",
        _STREAM: [
            (r"embeddings\.\w+_embeddings\.weight$", 1),
            (r"attention\.[qkv]_lin\.weight$", 1),
            (r"ffn\.lin1\.weight$", 1),
            (r"pre_classifier\.weight$", 1),
            (r"(out_lin|ffn\.lin2)\.(weight|bias)$", 0),
            (r"(LayerNorm|layer_norm)\.(weight|bias)$", 0),
        ],
        _MLP: [(r"ffn\.lin1\.(weight|bias)$", 0), (r"ffn\.lin2\.weight$", 1)],
    },
    "modernbert": {
        "signature": r"attn\.Wqkv",
        _STREAM: [
            (r"tok_embeddings\.weight$", 1),
            (r"(Wqkv|Wi)\.weight$", 1),
            (r"head\.dense\.weight$", 1),
            (r"(attn|mlp)\.Wo\.weight$", 0),
            (r"(embeddings\.norm|_norm)\.weight$", 0),
        ],
        _MLP2: [(r"mlp\.Wi\.weight$", 0)],
        _MLP: [(r"mlp\.Wo\.weight$", 1)],
    },
    "dinov2": {
        "signature": r"layer_scale1",
        _STREAM: [
            (r"(cls_token|position_embeddings)$", 2),
            (r"mask_token$", 1),
            (r"patch_embeddings\.projection\.(weight|bias)$", 0),
            (r"attention\.[qkv]_proj\.weight$", 1),
            (r"mlp\.fc1\.weight$", 1),
            (r"(o_proj|fc2)\.(weight|bias)$", 0),
            (r"lambda1$", 0),
            (r"(norm\d|layernorm)\.(weight|bias)$", 0),
            (r"classifier\.weight$", "1x2"),
        ],
        _MLP: [(r"mlp\.fc1\.(weight|bias)$", 0), (r"mlp\.fc2\.weight$", 1)],
    },
}


def _layout(model) -> dict | None:
    """The layout whose signature the model's parameter names carry (None: not tabled here; GPT-2,
    ViT, DeiT and DeBERTa have tests of their own)."""
    names = [n for n, _ in model.named_parameters()]
    found = [k for k, v in _LAYOUTS.items() if any(re.search(v["signature"], n) for n in names)]
    assert len(found) <= 1, found
    return _LAYOUTS[found[0]] if found else None


def _first(rules, name):
    return next((axis for pattern, axis in rules if re.search(pattern, name)), None)


@torch.no_grad()
def hand_permutation(model, seed: int):
    """Permute the residual stream and every layer's MLP units of ``model`` in place, parameter by
    parameter as :data:`_LAYOUTS` names them; returns the stream permutation."""
    layout = _layout(model)
    g = torch.Generator().manual_seed(seed)
    d = model.config.hidden_size
    stream = torch.randperm(d, generator=g)
    units: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        layer = re.search(r"\.(\d+)\.", name)
        axis = _first(layout[_STREAM], name)
        if axis == "1x2":  # reads two tokens' streams side by side
            p.copy_(p[:, torch.cat([stream, d + stream])])
        elif axis is not None and p.shape[axis] == d:
            p.copy_(p.index_select(axis, stream))
        for kind in (_MLP, _MLP2):
            axis = _first(layout.get(kind, []), name)
            if axis is None:
                continue
            f = p.shape[axis] // (2 if kind == _MLP2 else 1)
            perm = units.setdefault(layer.group(1), torch.randperm(f, generator=g))
            p.copy_(p.index_select(axis, torch.cat([perm, f + perm]) if kind == _MLP2 else perm))
            break
    return stream


FAMILIES = architectures()


def _trained(model_type, d=64, seed=0):
    shape = dict(hidden_size=d, num_heads=4, num_layers=4, intermediate_size=2 * d + 16)
    if is_decoder(model_type):
        model = tiny_model(model_type, "causal", seed=seed, vocab_size=VOCAB, num_kv_heads=2, **shape)
        return trained_like(model, seed=seed, massive=1000.0, twins=300.0).float()
    return trained_like(tiny_model(model_type, tiny_architecture(model_type).task_head, seed=seed, **shape)).float()


def _data(model_type, n=None):
    if is_decoder(model_type):
        return tiny_tokenizer(VOCAB), tiny_text_dataset(n or 192, vocab_size=VOCAB)
    return tiny_data(model_type, n or 128)


def _check_inputs(model):
    if not is_decoder(model.config.model_type):
        return example_inputs(model)
    texts = list(tiny_text_dataset(6, vocab_size=VOCAB, seed=99)["text"])
    return dict(tiny_tokenizer(VOCAB)(texts, return_tensors="pt", padding=True))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_permutation_written_from_the_equations_is_exact(model_type):
    """Every family's stream and MLP units permuted by name keep its function (float64)."""
    model = tiny_model(model_type, tiny_architecture(model_type).task_head)
    if _layout(model) is None:
        pytest.skip(f"{model_type}: no layout table here (its own tests cover its permutations)")
    moved = clone(model)
    stream = hand_permutation(moved, seed=4)
    changed = [
        n for (n, p), q in zip(model.named_parameters(), moved.parameters(), strict=True) if not torch.equal(p, q)
    ]
    assert len(changed) > 4 * model.config.num_hidden_layers
    eye = torch.eye(model.config.hidden_size, dtype=torch.float64)
    assert _deviation(model, moved, eye[:, stream]) <= 1e-9


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_permutation_written_from_the_equations_merges_back(model_type, precision):
    """B = the hand-written permutation of a trained-like A: merge(A, B) gives A back."""
    a = _trained(model_type)
    if _layout(a) is None:
        pytest.skip(f"{model_type}: no layout table here (its own tests cover its permutations)")
    b = clone(a)
    hand_permutation(b, seed=5)
    reference = clone(a)
    pre, data = _data(model_type)
    options = {"calibration": {"moment_precision": precision}}
    result = RaotMerger.from_models(a, b, preprocessor=pre, **options).merge(calibration=data)
    assert result.report["calibration"]["moment_precision"]["used"] == precision
    moved = {d.transform for d in result.alignment.decisions if d.applied}
    assert {"mlp", "residual"} <= moved and result.alignment.exact  # the heads were left in place by B
    inputs = _check_inputs(reference)
    assert output_deviation(reference, result.model, inputs, relative=True) <= 1e-4
    if is_decoder(model_type):
        ids = inputs["input_ids"][:2, :5]
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(reference.generate(input_ids=ids, **kw), result.model.generate(input_ids=ids, **kw))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_siblings_share_a_basis(model_type):
    """Two fine-tunes of one base: the gate keeps the identity everywhere."""
    head = "sequence" if "sequence" in tiny_architecture(model_type).heads else "image"  # a head with a loss
    shape = dict(hidden_size=32, num_heads=4, intermediate_size=48)
    if is_decoder(model_type):
        shape.update(vocab_size=40, num_kv_heads=2)
    # a base of unit-gain weights: 30 SGD steps move it as a fine-tune does, not away from it
    base = trained_like(tiny_model(model_type, head, dtype=torch.float32, **shape))
    a, b = fine_tune(clone(base), 1), fine_tune(clone(base), 2)
    pre, data = tiny_data(model_type, 256)
    result = RaotMerger.from_models(a, b, preprocessor=pre).merge(calibration=data)
    assert result.alignment.decisions and not any(d.applied for d in result.alignment.decisions)
    assert result.alignment.verdict_code in (Verdict.SHARES_BASIS, Verdict.SIBLINGS)
    assert "shares a basis" in result.report["summary"]


@pytest.mark.parametrize("rule", ["linear", "task_arithmetic"])
@pytest.mark.parametrize("model_type", architectures(experts=None))  # mixtures of experts too (§10)
def test_plain_rules_merge_every_family(model_type, rule):
    """No alignment, a per-tensor rule: the merge is the rule applied tensor by tensor — linear: the
    mean of A and B, bit for bit; task arithmetic on two fine-tunes of a base (its default weights ½):
    base + ½·(A − base) + ½·(B − base), the same mean to float rounding."""
    from raot_hf.symmetry import model_state

    head = tiny_architecture(model_type).task_head
    shape = dict(vocab_size=VOCAB, num_kv_heads=2) if is_decoder(model_type) else {}
    base = tiny_model(model_type, head, seed=0, dtype=torch.float32, **shape)
    a, b = clone(base), tiny_model(model_type, head, seed=1, dtype=torch.float32, **shape)
    if rule == "task_arithmetic":  # siblings: the base moved a little, two ways
        a, b = clone(base), clone(base)
        for i, model in enumerate((a, b)):
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * p.abs().mean() * torch.randn(p.shape, generator=g))
    state_a, state_b = model_state(clone(a)), model_state(clone(b))
    options = {"alignment": "none", "merge_rule": rule, "correction": "none", "refit": {"mode": "off"}}
    if rule == "task_arithmetic":
        options["base_model"] = clone(base)
    result = RaotMerger.from_models(a, b, **options).merge()
    merged, head_params = model_state(result.model), set(schema_for(result.model).head_params)
    assert result.report["merge"]["rule"] == rule
    for name, value in merged.items():
        if name in head_params:
            continue
        mean = (state_a[name].double() + state_b[name].double()) / 2
        if rule == "linear":
            assert torch.equal(value, mean.to(value.dtype)), name
        else:
            assert torch.allclose(value.double(), mean, rtol=1e-6, atol=1e-6), name


def test_the_readme_table_lists_every_family_and_its_tests():
    """README's table of what runs where names every registered model type once, and each cell
    links a test that exists."""
    from pathlib import Path

    from raot_hf import supported_model_types

    root = Path(__file__).resolve().parents[2]
    text = (root / "README.md").read_text(encoding="utf-8")
    section = text.split("## Families", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "[✓]" in line]
    listed = [t for row in rows for t in re.findall(r"`([\w-]+)`", row.split("|")[1])]
    assert sorted(listed) == supported_model_types()
    links = dict(re.findall(r"^\[(\w+)\]: (tests/[\w/]+\.py#\w+)$", section, re.MULTILINE))
    for row in rows:
        cells = re.findall(r"\[✓\]\[(\w+)\]", row)
        not_run = [c.strip() for c in row.split("|")[2:-1]].count("—")  # a path a family does not take
        assert len(cells) + not_run == 4 and all(c in links for c in cells), row
    for target in links.values():
        path, test = target.split("#")
        assert f"def {test}(" in (root / path).read_text(encoding="utf-8"), target
