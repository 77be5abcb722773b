"""A bitwise record of merges: the SHA-256 of every tensor a fixed set of merges writes.

A restructuring that must not change one merged byte (a family moved to another description, a
stage reorganised) is checked by recording before and after and comparing::

    python benchmarks/bitwise.py record --out before.json          # on the old code
    python benchmarks/bitwise.py record --out after.json           # on the new code
    python benchmarks/bitwise.py compare before.json after.json    # exit status 1 on any difference

To record another commit's code, check it out beside this one and put it first on the path (the
script imports only ``raot_hf``'s public names, so it runs against older commits too)::

    git worktree add /tmp/old <commit>
    PYTHONPATH=/tmp/old python benchmarks/bitwise.py record --out before.json

The merges, per architecture of ``raot_hf.testing.architectures(variants=True)`` (with the task
head each one registers), on trained-like tiny models (peaked attention; massive activations in
decoders): the recovery of an exact scramble and the aligned merge of two seeds, each under both
moment precisions; three models; weight matching; RegMean; and the layer-wise merge of models
offloaded to working files. ``--trained`` adds pairs trained for a few hundred steps (a ViT on
scikit-learn digits, a BERT classifier and GPT-2 / Llama language models on a synthetic corpus).
Each record also holds a digest of every schema (architecture × head), so a difference can be
traced to the description of a family before any merge runs. Everything runs single-threaded,
the refit's steps pinned (``REFIT_STEPS``); records of one machine compare bit for bit, records of
two machines need not.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

VOCAB = 100
SHAPE = dict(hidden_size=32, num_heads=4, num_layers=3, intermediate_size=80)
CASES = ("recovery-float32", "recovery-bfloat16", "seeds-float32", "seeds-bfloat16", "three-models",
         "weight", "regmean", "layerwise")  # fmt: skip


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    head = f"{t.dtype}|{tuple(t.shape)}|".encode()
    return hashlib.sha256(head + t.view(torch.uint8).numpy().tobytes() if t.numel() else head).hexdigest()


def _saved_digests(result, out: Path) -> dict[str, str]:
    """Write the merge as a user would and hash every tensor of the written safetensors."""
    from safetensors.torch import load_file

    result.save_pretrained(out)
    tensors = {}
    for shard in sorted(out.glob("model*.safetensors")):
        tensors.update(load_file(shard))
    transform = out / "raot_transform.safetensors"  # the applied alignment, where one was applied
    if transform.is_file():
        tensors.update({f"transform:{k}": v for k, v in load_file(transform).items()})
    return {name: _digest(tensors[name]) for name in sorted(tensors)}


def _model(model_type: str, seed: int):
    from raot_hf.testing import tiny_architecture, tiny_model, trained_like

    arch = tiny_architecture(model_type)
    shape = dict(SHAPE)
    decoder = "causal" in arch.heads
    if decoder:
        shape.update(vocab_size=VOCAB, num_kv_heads=2)
    model = tiny_model(model_type, arch.task_head, seed=seed, **shape)
    try:
        return trained_like(model, seed=seed, massive=300.0 if decoder else None).float()
    except Exception:  # a family trained_like cannot plant massive activations in
        return trained_like(model, seed=seed).float()


def _data(model_type: str):
    from raot_hf.testing import tiny_architecture, tiny_data

    decoder = "causal" in tiny_architecture(model_type).heads
    return tiny_data(model_type, 160, vocab_size=VOCAB) if decoder else tiny_data(model_type, 128)


#: The refit's steps, pinned: by default (``auto``) they follow the time the rest of the merge took
#: on the host, and two records of one machine would differ wherever the refit runs.
REFIT_STEPS = 20


def _merge(models, pre, data, **options):
    from raot_hf import RaotMerger

    options.setdefault("refit", {"steps": REFIT_STEPS})
    return RaotMerger.from_models(*models, preprocessor=pre, **options).merge(calibration=data)


def _precision(name: str) -> dict:
    return {"calibration": {"moment_precision": name}}


def _layerwise(a, b, pre, data, root: Path):
    """The two models saved, loaded back offloaded to working files, merged layer by layer."""
    from raot_hf import RaotMerger

    for name, m in (("a", a), ("b", b)):
        m.save_pretrained(root / name)
        pre.save_pretrained(root / name)
    (root / "work").mkdir()
    merger = RaotMerger.from_pretrained(
        root / "a", root / "b", offload="always", offload_dir=root / "work", dtype="float32", **_precision("float32")
    )
    merger.preprocessor = pre  # a saved word-level tokenizer may reload as the family's own class
    return merger.merge(calibration=data)


def run_case(model_type: str, case: str, root: Path):
    from raot_hf import scramble
    from raot_hf.testing import clone

    pre, data = _data(model_type)
    a = _model(model_type, 0)
    if case.startswith("recovery"):
        b = clone(a)
        scramble(b, seed=1)
        return _merge([a, b], pre, data, **_precision(case.split("-")[1]))
    b = _model(model_type, 1)
    if case.startswith("seeds"):
        return _merge([a, b], pre, data, **_precision(case.split("-")[1]))
    if case == "three-models":
        return _merge([a, b, _model(model_type, 2)], pre, data, **_precision("float32"))
    if case == "weight":
        return _merge([a, b], pre, data, alignment="weight")
    if case == "regmean":
        return _merge([a, b], pre, data, merge_rule="regmean", **_precision("float32"))
    if case == "layerwise":
        return _layerwise(a, b, pre, data, root)
    raise ValueError(f"unknown case {case!r}; choose from {', '.join(CASES)}")


# ------------------------------------------------------------------ schemas (architecture × head)
def _plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def schema_records(model_types: list[str]) -> dict[str, dict]:
    """Every schema field of every architecture × head (the tiny models' shapes), as plain data."""
    from raot_hf import schema_for
    from raot_hf.testing import tiny_architecture, tiny_model

    out = {}
    for t in model_types:
        arch = tiny_architecture(t)
        for head in arch.heads:
            variants = [{}]
            if "causal" in arch.heads:
                variants = [{"tie_word_embeddings": False}, {"tie_word_embeddings": True}]
            for extra in variants:
                key = f"{t}/{head}" + ("/tied" if extra.get("tie_word_embeddings") else "")
                out[key] = _plain(schema_for(tiny_model(t, head, **extra)))
    return out


# --------------------------------------------------------------------------- trained pairs
def _synthetic_texts(n: int, seed: int):
    """Sentences of a small grammar: a label word, then words drawn from the label's half of the
    vocabulary, so a classifier and a language model both have something to learn."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows, labels = [], []
    for _ in range(n):
        label = int(torch.randint(0, 2, (1,), generator=g))
        low, high = (5, 50) if label == 0 else (50, VOCAB)
        length = int(torch.randint(6, 14, (1,), generator=g))
        words = [int(torch.randint(low, high, (1,), generator=g)) for _ in range(length)]
        words = [w if i % 3 else 5 + (w + 7) % (VOCAB - 5) for i, w in enumerate(words)]  # a local pattern
        rows.append(" ".join(f"w{w}" for w in words))
        labels.append(label)
    return datasets.Dataset.from_dict({"text": rows, "label": labels})


def _train_text(model, data, pre, steps: int, seed: int, causal: bool):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model.train()
    texts, labels = list(data["text"]), torch.tensor(data["label"])
    for _ in range(steps):
        idx = torch.randint(0, len(texts), (16,), generator=g)
        batch = pre([texts[i] for i in idx], return_tensors="pt", padding=True)
        if causal:
            ids = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            loss = model(**batch, labels=ids).loss
        else:
            loss = model(**batch, labels=labels[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def trained_pairs() -> dict[str, tuple]:
    """(A, B, preprocessor, calibration) of small trained pairs: ViT on digits (raot_hf.demo),
    BERT classifiers and GPT-2 / Llama language models on the synthetic corpus."""
    from raot_hf.testing import tiny_image_processor, tiny_model, tiny_tokenizer

    pairs = {}
    tok = tiny_tokenizer(VOCAB)
    corpus, calibration = _synthetic_texts(600, 0), _synthetic_texts(128, 99)
    shape = dict(hidden_size=32, num_heads=4, num_layers=2, intermediate_size=64)
    torch.manual_seed(0)
    pairs["bert-trained"] = tuple(
        _train_text(tiny_model("bert", "sequence", seed=s, num_labels=2, vocab_size=VOCAB, **shape).float(),
                    corpus, tok, 150, s, causal=False)
        for s in (0, 1)
    ) + (tok, calibration)  # fmt: skip
    for arch in ("gpt2", "llama"):
        pairs[f"{arch}-trained"] = tuple(
            _train_text(tiny_model(arch, "causal", seed=s, vocab_size=VOCAB, num_kv_heads=2, **shape).float(),
                        corpus, tok, 150, s, causal=True)
            for s in (0, 1)
        ) + (tok, calibration)  # fmt: skip
    pairs["vit-trained"] = _vit_pair() + (tiny_image_processor(8), _digit_images(96, 99))
    return pairs


def _digit_images(n: int, seed: int):
    import datasets
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(digits.images), n, replace=False)
    images = [Image.fromarray((digits.images[i] * 16).clip(0, 255).astype(np.uint8)).convert("RGB") for i in pick]
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": images, "label": [int(digits.target[i]) for i in pick]}, features=feats)


def _vit_pair():
    from raot_hf.testing import tiny_image_processor, tiny_model

    data = _digit_images(600, 0)
    pre = tiny_image_processor(8)
    out = []
    for s in (0, 1):
        model = tiny_model("vit", "image", seed=s, num_labels=10, hidden_size=32, num_heads=4, num_layers=2,
                           intermediate_size=64, patch_size=2).float()  # fmt: skip
        g = torch.Generator().manual_seed(s)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        model.train()
        for _ in range(150):
            idx = torch.randint(0, len(data), (32,), generator=g).tolist()
            rows = data.select(idx)
            pixels = pre([im for im in rows["image"]], return_tensors="pt")["pixel_values"]
            loss = model(pixel_values=pixels, labels=torch.tensor(rows["label"])).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        out.append(model.eval())
    return tuple(out)


# ---------------------------------------------------------------------------------- commands
def _git(*args: str) -> str:
    try:
        import raot_hf

        where = Path(raot_hf.__file__).resolve().parents[1]
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def _machine() -> dict:
    """The platform, the CPU's model and its bf16 matrix instructions (which decide ``auto``), torch."""
    cpu, flags = platform.processor(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), cpu)
        flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
    cores = os.cpu_count()
    return {"platform": platform.platform(), "cpu": cpu, "bf16": bf16, "cores": cores, "torch": torch.__version__}


def record(out: Path, only: list[str] | None, trained: bool, cases: tuple[str, ...], commit: str = "") -> dict:
    torch.set_num_threads(1)
    import raot_hf
    from raot_hf.testing import architectures

    types = [t for t in architectures(variants=True) if not only or t in only]
    rec = {
        "commit": commit or _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "raot_hf": str(Path(raot_hf.__file__).resolve().parent),
        "command": " ".join(sys.argv),
        "machine": _machine(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "schemas": schema_records(types),
        "merges": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for t in types:
            for case in cases:
                start = time.perf_counter()
                root = Path(tmp) / f"{t}-{case}"
                result = run_case(t, case, root)
                rec["merges"][f"{t}/{case}"] = _saved_digests(result, root / "out")
                print(f"{t}/{case}: {len(rec['merges'][f'{t}/{case}'])} tensors, {time.perf_counter() - start:.1f}s")
        if trained:
            from raot_hf.testing import clone

            for name, (a, b, pre, data) in trained_pairs().items():
                for precision in ("float32", "bfloat16"):
                    key = f"{name}/seeds-{precision}"
                    result = _merge([clone(a), clone(b)], pre, data, **_precision(precision))
                    rec["merges"][key] = _saved_digests(result, Path(tmp) / key.replace("/", "-"))
                    print(f"{key}: {len(rec['merges'][key])} tensors")
    out.write_text(json.dumps(rec, indent=1, sort_keys=True))
    return rec


def _schema_diff(a, b, path: str) -> list[str]:
    """Where two schema records differ; a field only the second has (added since, with its
    default) is not a difference."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k} (only in the first)" for k in a if k not in b]
        return out + [d for k in a if k in b for d in _schema_diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _schema_diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def compare(before: dict, after: dict) -> list[str]:
    """Every difference between two records over what both hold (merges, schema fields), and what
    only one of them holds."""
    lines = []
    for section in ("schemas", "merges"):
        old, new = before[section], after[section]
        for key in sorted(set(old) - set(new)):
            lines.append(f"{section}: {key} only in the first record")
        added = sorted(set(new) - set(old))
        if added:
            families = sorted({key.split("/")[0] for key in added})
            lines.append(f"{section}: {len(added)} only in the second record, not compared ({', '.join(families)})")
        for key in sorted(set(old) & set(new)):
            a, b = old[key], new[key]
            if section == "schemas":
                diff = sorted({path.split("[")[0] for path in _schema_diff(a, b, "")})
            else:
                diff = [n for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)]
            if diff == [".notes"]:  # human-readable remarks only: no stage reads them
                lines.append(f"{section}: {key} notes (text) differ")
            elif diff:
                lines.append(f"{section}: {key} differs in {len(diff)}: {', '.join(diff[:6])}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run the merges and write their tensor hashes")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--only", default="", help="comma-separated model types (default: every one)")
    rec.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    rec.add_argument("--commit", default="", help="the commit recorded (default: git's, where raot_hf is)")
    rec.add_argument("--trained", action="store_true", help="add the small trained pairs (a few minutes)")
    cmp = sub.add_parser("compare", help="compare two records; exit status 1 on a difference")
    cmp.add_argument("first", type=Path)
    cmp.add_argument("second", type=Path)
    cmp.add_argument("--out", type=Path, help="also write the comparison (both records' provenance) as JSON")
    args = parser.parse_args(argv)
    if args.command == "record":
        only = [t for t in args.only.split(",") if t] or None
        record(args.out, only, args.trained, tuple(c for c in args.cases.split(",") if c), args.commit)
        return 0
    first, second = (json.loads(p.read_text()) for p in (args.first, args.second))
    lines = compare(first, second)
    shared = set(first["merges"]) & set(second["merges"])
    tensors = sum(len(first["merges"][k]) for k in shared)
    print("\n".join(lines) if lines else "no difference")
    schemas = len(set(first["schemas"]) & set(second["schemas"]))
    print(f"compared {len(shared)} merges ({tensors} tensors) and {schemas} schemas")
    if args.out is not None:
        keys = ("commit", "dirty", "command", "machine", "when")
        summary = {
            "records": [{k: rec.get(k) for k in keys} for rec in (first, second)],
            "command": " ".join(sys.argv),
            "merges_compared": len(shared),
            "tensors_compared": tensors,
            "schemas_compared": schemas,
            "differences": lines,
        }
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if any("differs" in line or "only in the first" in line for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
