"""mergekit's configuration language, verbatim (docs/design.md §6.9, §6.10): every config of
``mergekit_corpus/`` — shapes copied from mergekit's examples and from model cards — runs with no
other flag from the folder holding its models (tiny stand-ins saved under the cards' Hub ids),
and the output loads with ``AutoModelForCausalLM`` and generates. For linear, task arithmetic,
TIES, DARE-TIES and SLERP the output equals mergekit's documented arithmetic, written below from
the documentation (float64, then rounded to the output dtype: equal to one rounding step of it);
the union vocabulary equals one built here; every config of ``refused/`` is refused in one line."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from raot_hf.cli import main
from raot_hf.merging.vocab import CHAT_TEMPLATES
from raot_hf.testing import clone, tiny_model, tiny_tokenizer

#: Layers of every stand-in (the cards' layer ranges are written for it).
LAYERS = 8
BASE = "mistralai/Mistral-7B-v0.1"
FINE_TUNES = (
    "mistralai/Mistral-7B-Instruct-v0.2",
    "teknium/OpenHermes-2.5-Mistral-7B",
    "NousResearch/Hermes-2-Pro-Mistral-7B",
    "mlabonne/NeuralHermes-2.5-Mistral-7B",
    "OpenPipe/mistral-ft-optimized-1218",
    "WizardLM/WizardMath-7B-V1.1",
    "BioMistral/BioMistral-7B",
)
#: A fine-tune whose tokenizer adds ChatML's tokens (two more embedding rows).
EXTRA_TOKENS = "cognitivecomputations/dolphin-2.2.1-mistral-7b"
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
#: Chat templates the stand-ins carry (the tokenizer of each name).
TEMPLATES = {
    "mistralai/Mistral-7B-Instruct-v0.2": "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}",
    "teknium/OpenHermes-2.5-Mistral-7B": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
    "NousResearch/Hermes-2-Pro-Mistral-7B": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
    EXTRA_TOKENS: "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
}


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=g))
    return model


def save_corpus_models(root: Path) -> Path:
    """Tiny stand-ins for the checkpoints the corpus names: a base and fine-tunes of it (the base
    plus a small perturbation), saved under ``root`` by the Hub ids the model cards use. Save the base, the fine-tunes and the extra-token fine-tune under ``root``; returns ``root``."""
    base = tiny_model("mistral", "causal", dtype=torch.float32, num_layers=LAYERS)
    models = {BASE: base, **{name: _perturbed(clone(base), i) for i, name in enumerate(FINE_TUNES, start=1)}}
    extra = _perturbed(clone(base), 99)
    extra.resize_token_embeddings(base.config.vocab_size + len(CHATML_TOKENS), mean_resizing=False)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for weight in (extra.get_input_embeddings().weight, extra.get_output_embeddings().weight):
            weight[-len(CHATML_TOKENS) :] = 0.1 * torch.randn(len(CHATML_TOKENS), weight.shape[1], generator=g)
    models[EXTRA_TOKENS] = extra
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer = tiny_tokenizer(base.config.vocab_size)
        if name == EXTRA_TOKENS:
            tokenizer.add_special_tokens({"additional_special_tokens": list(CHATML_TOKENS)})
        if name in TEMPLATES:
            tokenizer.chat_template = TEMPLATES[name]
        tokenizer.save_pretrained(root / name)
    return root


CORPUS = Path(__file__).parent / "mergekit_corpus"
CONFIGS = sorted(p.name for p in CORPUS.glob("*.yml"))
REFUSED = sorted(p.name for p in (CORPUS / "refused").glob("*.yml"))
_RUNS: dict[str, Path] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return save_corpus_models(tmp_path_factory.mktemp("corpus"))


def _run(root: Path, name: str, monkeypatch) -> Path:
    """``raot-hf merge --config <name> --out <dir>`` from the models' folder, once per config."""
    monkeypatch.chdir(root)  # the configs name their models relative to this folder
    if name not in _RUNS:
        out = root / "out" / name.removesuffix(".yml")
        res = CliRunner().invoke(main, ["merge", "--config", str(CORPUS / name), "--out", str(out)])
        assert res.exit_code == 0, (res.output, repr(res.exception))
        assert "--calibration" in res.stderr or "alignment does not apply" in res.stderr  # the one line on alignment
        _RUNS[name] = out
    return _RUNS[name]


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _data(name: str) -> dict:
    return yaml.safe_load((CORPUS / name).read_text())


def test_the_corpus_has_every_shape_the_language_has():
    assert len(CONFIGS) >= 20
    methods = {d["merge_method"] for n in CONFIGS for d in yaml.safe_load_all((CORPUS / n).read_text())}
    assert methods >= {"linear", "task_arithmetic", "ties", "dare_ties", "dare_linear", "slerp", "nuslerp",
                       "model_stock", "della", "della_linear", "breadcrumbs", "breadcrumbs_ties", "passthrough"}  # fmt: skip
    text = "\n".join((CORPUS / n).read_text() for n in CONFIGS)
    for needle in ("filter:", "tokenizer_source: union", "source: union", "chat_template: auto", "out_dtype:", "---",
                   "layer_range: [2, 8]", "lambda:", "rescale: false"):  # fmt: skip
        assert needle in text, needle


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_runs_verbatim_and_generates(root, name, monkeypatch):
    out = _run(root, name, monkeypatch)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    generated = model.generate(torch.tensor([[1, 5, 6, 7]]), max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 7)
    assert transformers.AutoTokenizer.from_pretrained(out).get_vocab()
    report = json.loads((out / "raot_report.json").read_text())
    documents = list(yaml.safe_load_all((CORPUS / name).read_text()))
    data = documents[-1]
    assert report["execution"] == "streamed" and report["merge_file"] == data
    layers = sum(s["sources"][0]["layer_range"][1] - s["sources"][0]["layer_range"][0] for s in data.get("slices", []))
    assert model.config.num_hidden_layers == (layers or LAYERS)
    if data["merge_method"] == "passthrough":
        assert report["verdict"].startswith("alignment does not apply")
    dtype = data.get("out_dtype") or data.get("dtype") or "float32"
    assert model.dtype == getattr(torch, dtype)
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []  # no stage left behind


@pytest.mark.parametrize("name", REFUSED)
def test_each_unsupported_form_is_refused_in_one_line(root, name, monkeypatch, tmp_path):
    expected = re.match(r"# refused: (.*)", (CORPUS / "refused" / name).read_text()).group(1)
    monkeypatch.chdir(root)
    res = CliRunner().invoke(main, ["merge", "--config", str(CORPUS / "refused" / name), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert expected in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- mergekit's arithmetic, by hand


def _layer(name: str) -> int | None:
    match = re.search(r"\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def _value(setting, name: str, t: float):
    """mergekit's documented reading of a parameter: a number, a gradient (interpolated at the
    layer's place t in [0, 1]) or a list of {filter, value} (the first whose filter is in the name)."""
    if setting is None:
        return None
    if isinstance(setting, (int, float)):
        return float(setting)
    if all(isinstance(v, (int, float)) for v in setting):
        return float(np.interp(t, np.linspace(0.0, 1.0, len(setting)), setting))
    for entry in setting:
        if "filter" not in entry or entry["filter"] in name:
            return _value(entry["value"], name, t)
    return None


def _parameter(levels: list[dict], key: str, name: str, t: float, default=None):
    """The most specific level's value (the model's, then the slice's, then the whole merge's)."""
    for level in levels:
        value = _value((level or {}).get(key), name, t)
        if value is not None:
            return value
    return default


def _place(name: str) -> float:
    layer = _layer(name)
    return 0.0 if layer is None else layer / (LAYERS - 1)


def _assert_rounded(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """``got`` is ``want`` (float64) rounded to ``got``'s dtype: within one rounding step."""
    info = torch.finfo(got.dtype)
    step = info.eps * want.abs() + info.tiny
    assert (got.double() - want).abs().le(step).all(), (name, float((got.double() - want).abs().max()))


def _inputs(root: Path, name: str):
    """The config, its merged models with their parameters (SLERP: the base first; the others: the
    base left out), the slice's parameters and the base's tensors (the task vectors' origin)."""
    data = _data(name)
    if "slices" in data:
        (piece,) = data["slices"]
        entries, slice_params = piece["sources"], piece.get("parameters")
    else:
        entries, slice_params = data["models"], None
    base = data.get("base_model")
    dtype = getattr(torch, data.get("dtype", "float32"))
    read = lambda m: {k: v.to(dtype).double() for k, v in _weights(root / m).items()}  # noqa: E731
    if data["merge_method"] == "slerp":
        entries = sorted(entries, key=lambda e: e["model"] != base)
        return data, [(read(e["model"]), e.get("parameters") or {}) for e in entries], slice_params, None
    models = [(read(e["model"]), e.get("parameters") or {}) for e in entries if e["model"] != base]
    return data, models, slice_params, read(base) if base else None


def _dare_mask(shape, density: float, seed: int, name: str, model: int) -> torch.Tensor:
    """DARE's draw as the report documents it: sha256(seed, parameter, model) seeds a torch.Generator."""
    digest = hashlib.sha256(f"{seed}\0{name}\0model{model}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.rand(shape, generator=g, dtype=torch.float64) < density


def _task_vectors(name, data, models, slice_params, origin, sparsify, elect, normalize, rescale, seed=0):
    """mergekit's generalized task arithmetic for one tensor (merge_methods.md)."""
    t = _place(name)
    top = data.get("parameters") or {}
    deltas, weights = [], []
    for i, (state, own) in enumerate(models):
        levels = [own, slice_params, top]
        weights.append(_parameter(levels, "weight", name, t))
        density = _parameter(levels, "density", name, t, 1.0)
        delta = state[name] - origin[name]
        if density < 1.0:
            if sparsify == "magnitude":
                keep = torch.zeros(delta.numel(), dtype=torch.bool)
                keep[torch.argsort(delta.abs().flatten(), descending=True)[: int(density * delta.numel())]] = True
                kept = delta * keep.view_as(delta)
            else:
                kept = delta * _dare_mask(delta.shape, density, seed, name, i)
            if rescale and kept.abs().sum() > 1e-7:
                kept = kept * (delta.abs().sum() / kept.abs().sum())
            delta = kept
        deltas.append(delta)
    weighted = torch.stack([w * d for w, d in zip(weights, deltas, strict=True)])
    w = torch.tensor(weights, dtype=torch.float64).view(-1, *[1] * deltas[0].dim())
    if elect:
        majority = torch.where(weighted.sum(0) >= 0, 1.0, -1.0)
        agree = weighted.sign() == majority
        mixed, divisor = (weighted * agree).sum(0), (w * agree).sum(0)
        divisor[divisor == 0] = 1.0
    else:
        mixed, divisor = weighted.sum(0), w.sum(0)
    if normalize:
        mixed = mixed / divisor
    return origin[name] + _parameter([top], "lambda", name, t, 1.0) * mixed


def _slerp(t: float, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """SLERP of the flattened tensors (merge_methods.md): linear when nearly colinear."""
    u, v = a / a.norm(), b / b.norm()
    dot = float((u * v).sum())
    if abs(dot) > 0.9995:
        return (1 - t) * a + t * b
    theta = math.acos(dot)
    return (math.sin((1 - t) * theta) * a + math.sin(t * theta) * b) / math.sin(theta)


def _expected(name: str, data, models, slice_params, origin):
    method, top = data["merge_method"], data.get("parameters") or {}
    t = _place(name)
    if method == "linear":
        weights = [_parameter([own, top], "weight", name, t) for _, own in models]
        return sum(w * s[name] for w, (s, _) in zip(weights, models, strict=True)) / sum(weights)
    if method == "slerp":
        (a, _), (b, _) = models
        return _slerp(_parameter([top], "t", name, t), a[name], b[name])
    switches = {"task_arithmetic": (None, False, False, False), "ties": ("magnitude", True, True, False),
                "dare_ties": ("random", True, False, True)}[method]  # fmt: skip
    sparsify, elect, normalize, rescale = switches
    normalize = top.get("normalize", normalize)
    rescale = top.get("rescale", rescale)
    return _task_vectors(name, data, models, slice_params, origin, sparsify, elect, normalize, rescale)


@pytest.mark.parametrize(
    "name",
    ["linear.yml", "task_arithmetic.yml", "ties_two_models.yml", "gradients_every_level.yml", "dare_ties_card.yml",
     "dare_ties_lambda_rescale.yml", "slerp_card.yml", "slerp_models.yml"],
)  # fmt: skip
def test_outputs_are_mergekits_documented_arithmetic(root, name, monkeypatch):
    merged = _weights(_run(root, name, monkeypatch))
    data, models, slice_params, origin = _inputs(root, name)
    assert set(merged) == set(models[0][0])
    for tensor_name, got in merged.items():
        _assert_rounded(got, _expected(tensor_name, data, models, slice_params, origin), tensor_name)


def test_precedence_source_over_slice_over_the_whole_merge(root, monkeypatch):
    """gradients_every_level.yml: one model's weight comes from its own filters, the others' from
    the whole merge; the densities from the slice (over the merge's); lambda's filter by module."""
    data = _data("gradients_every_level.yml")
    piece = data["slices"][0]
    own = piece["sources"][1]["parameters"]
    name = "model.layers.7.self_attn.q_proj.weight"
    assert _parameter([own, piece["parameters"], data["parameters"]], "weight", name, 1.0) == 0.8
    assert _parameter([{}, piece["parameters"], data["parameters"]], "weight", name, 1.0) == 0.3
    assert _parameter([{}, piece["parameters"], data["parameters"]], "density", name, 1.0) == 0.5
    merged = _weights(_run(root, "gradients_every_level.yml", monkeypatch))
    # the rule with the merge's density (0.1) instead of the slice's differs: the slice's was read
    data_without = {**data, "slices": [{**piece, "parameters": {}}]}
    _, models, _, origin = _inputs(root, "gradients_every_level.yml")
    other = _expected(name, data_without, models, {}, origin)
    assert not torch.allclose(merged[name].double(), other)


# ----------------------------------------------------------------------------- tokenizers and chat templates


def test_union_vocabulary_and_rows_follow_mergekit(root, monkeypatch):
    out = _run(root, "tokenizer_union.yml", monkeypatch)
    first = transformers.AutoTokenizer.from_pretrained(root / "mistralai/Mistral-7B-Instruct-v0.2")
    other = transformers.AutoTokenizer.from_pretrained(root / EXTRA_TOKENS)
    # the first model's vocabulary, then the other's tokens it lacks, in the other's order
    vocabulary = dict(first.get_vocab())
    for token, _ in sorted(other.get_vocab().items(), key=lambda item: item[1]):
        vocabulary.setdefault(token, len(vocabulary))
    written = transformers.AutoTokenizer.from_pretrained(out)
    assert written.get_vocab() == vocabulary and list(CHATML_TOKENS) == [
        t for t in vocabulary if t not in first.get_vocab()
    ]
    assert written.chat_template == CHAT_TEMPLATES["chatml"]
    a, b = _weights(root / "mistralai/Mistral-7B-Instruct-v0.2"), _weights(root / EXTRA_TOKENS)
    merged = _weights(out)
    size = 104  # 102 tokens padded to a multiple of 8
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        x, y = a[key].double(), b[key].double()
        rows = {}
        for model, own, vocab in ((x, "a", first.get_vocab()), (y, "b", other.get_vocab())):
            table = torch.zeros(size, x.shape[1], dtype=torch.float64)
            for token, index in vocabulary.items():
                if token == "w7":  # forced: the first model's row of w8
                    table[index] = x[first.get_vocab()["w8"]]
                elif token == "w9":  # forced: zeros
                    table[index] = 0.0
                elif token == "<|im_start|>":  # forced: the other model's row
                    table[index] = y[other.get_vocab()[token]]
                elif token in vocab:
                    table[index] = model[vocab[token]]
                else:  # only the other model has it: its row
                    table[index] = y[other.get_vocab()[token]]
            table[len(vocabulary) :] = table[: len(vocabulary)].mean(0)
            rows[own] = table
        _assert_rounded(merged[key], 0.5 * rows["a"] + 0.5 * rows["b"], key)


def test_chat_templates_auto_named_and_written_out(root, monkeypatch):
    auto = transformers.AutoTokenizer.from_pretrained(_run(root, "dare_ties_tokenizer_chat.yml", monkeypatch))
    hermes = TEMPLATES["teknium/OpenHermes-2.5-Mistral-7B"]
    assert auto.chat_template.strip() == hermes.strip()  # two of the models' tokenizers carry it
    literal = transformers.AutoTokenizer.from_pretrained(_run(root, "chat_template_literal.yml", monkeypatch))
    assert literal.chat_template == _data("chat_template_literal.yml")["chat_template"]
    plain = transformers.AutoTokenizer.from_pretrained(_run(root, "linear.yml", monkeypatch))
    assert not plain.chat_template  # no chat_template: the first model's tokenizer as it is


def test_out_dtype_writes_what_dtype_computed(root, monkeypatch):
    out = _run(root, "out_dtype.yml", monkeypatch)
    merged = _weights(out)
    a, b = _weights(root / "mistralai/Mistral-7B-Instruct-v0.2"), _weights(root / BASE)
    assert all(t.dtype == torch.bfloat16 for t in merged.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    for key, got in merged.items():
        _assert_rounded(got, 0.5 * a[key].double() + 0.5 * b[key].double(), key)


# ----------------------------------------------------------------------------- passthrough and several documents


def test_depth_up_scaling_stacks_the_layer_ranges(root, monkeypatch):
    out = _run(root, "passthrough_dus.yml", monkeypatch)
    merged, base = _weights(out), _weights(root / BASE)
    origins = [*range(0, 6), *range(2, 8)]
    for key, got in merged.items():
        layer = _layer(key)
        source = key if layer is None else key.replace(f".layers.{layer}.", f".layers.{origins[layer]}.")
        assert torch.equal(got, base[source].to(torch.bfloat16)), key
    assert len({_layer(k) for k in merged} - {None}) == 12


def test_a_frankenmerge_takes_each_slice_from_its_model_and_scales(root, monkeypatch):
    merged = _weights(_run(root, "passthrough_frankenmerge.yml", monkeypatch))
    first, second = (
        _weights(root / "mistralai/Mistral-7B-Instruct-v0.2"),
        _weights(root / "WizardLM/WizardMath-7B-V1.1"),
    )
    for key, got in merged.items():
        layer = _layer(key)
        if layer is None:  # before the layers from the first slice, after them from the last
            want = first[key] if "embed" in key else second[key]
        elif layer < 5:
            want = first[key]
        else:
            want = second[key.replace(f".layers.{layer}.", f".layers.{layer - 2}.")]
            want = want * 0.5 if "down_proj" in key else want
        _assert_rounded(got, want.double(), key)


def test_a_two_stage_file_is_its_documents_run_in_turn(root, monkeypatch, tmp_path):
    """multistage.yml's output equals its three documents run one by one, each later one naming
    the earlier outputs by path."""
    final = _weights(_run(root, "multistage.yml", monkeypatch))
    documents = list(yaml.safe_load_all((CORPUS / "multistage.yml").read_text()))
    outputs = {}
    for document in documents:
        text = yaml.safe_dump({k: v for k, v in document.items() if k != "name"})
        for name, path in outputs.items():
            text = text.replace(f"model: {name}", f"model: {path}").replace(
                f"base_model: {name}", f"base_model: {path}"
            )
        config = tmp_path / f"{document.get('name', 'final')}.yml"
        config.write_text(text)
        out = tmp_path / document.get("name", "final")
        res = CliRunner().invoke(main, ["-q", "merge", "--config", str(config), "--out", str(out)])
        assert res.exit_code == 0, res.output
        outputs[document.get("name")] = out
    alone = _weights(outputs[None])
    assert set(alone) == set(final) and all(torch.equal(alone[k], final[k]) for k in final)


def test_the_readme_model_card_config_runs_verbatim(root, monkeypatch):
    """README's merge-file example is the corpus's DARE-TIES card, and its command runs as written."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    text = re.search(r"```yaml\n# dare_ties\.yml\n(.*?)```", readme, re.S).group(1)
    command = re.search(r"```bash\n(raot-hf merge --config dare_ties\.yml[^\n]*)\n```", readme).group(1)
    assert yaml.safe_load(text) == _data("dare_ties_card.yml")
    (root / "dare_ties.yml").write_text(text)
    monkeypatch.chdir(root)
    res = CliRunner().invoke(main, ["-q", *command.split()[1:]])
    assert res.exit_code == 0, res.output
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "merged")
    assert model.generate(torch.tensor([[1, 5]]), max_new_tokens=2, do_sample=False).shape == (1, 4)


def test_python_runs_a_merge_file_as_the_command_line_does(root, monkeypatch, tmp_path):
    """``merge_checkpoints(out=…, config="merge.yml", **options)``: the same bytes as the command
    line; options apply to the file's merge (a seed draws other DARE masks); naming an alignment
    without calibration data is refused rather than merged as stored."""
    from raot_hf import RaotError, merge_checkpoints

    cli = _weights(_run(root, "dare_ties_card.yml", monkeypatch))
    out, report = merge_checkpoints(out=tmp_path / "py", config=CORPUS / "dare_ties_card.yml")
    python = _weights(out)
    assert report["execution"] == "streamed" and all(torch.equal(cli[k], python[k]) for k in cli)
    reseeded = _weights(merge_checkpoints(out=tmp_path / "seed", config=CORPUS / "dare_ties_card.yml", seed=3)[0])
    assert any(not torch.equal(cli[k], reseeded[k]) for k in cli)
    with pytest.raises(RaotError, match="needs calibration data"):
        merge_checkpoints(out=tmp_path / "aligned", config=CORPUS / "dare_ties_card.yml", alignment="activation")


def test_per_layer_config_lists_follow_the_stacked_layers(tmp_path):
    """Qwen2's ``layer_types`` (sliding or full attention per layer) follows the slices' layers."""
    model = tiny_model("qwen2", "causal", dtype=torch.float32, num_layers=4)
    model.config.layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    model.save_pretrained(tmp_path / "q")
    tiny_tokenizer(100).save_pretrained(tmp_path / "q")
    config = tmp_path / "dus.yml"
    q = tmp_path / "q"
    config.write_text(
        f"slices:\n  - sources:\n    - model: {q}\n      layer_range: [0, 2]\n  - sources:\n    - model: {q}\n"
        "      layer_range: [1, 4]\nmerge_method: passthrough\n"
    )
    res = CliRunner().invoke(main, ["-q", "merge", "--config", str(config), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    written = json.loads((tmp_path / "o" / "config.json").read_text())
    assert written["num_hidden_layers"] == 5
    assert written["layer_types"] == ["sliding_attention", "full_attention", "full_attention", "sliding_attention",
                                      "full_attention"]  # fmt: skip
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o").generate(torch.tensor([[1, 2]]), max_new_tokens=2)
