"""Time and peak memory of a merge against its floor (docs/design.md §7).

For each shape (a BERT-base-shaped pair, an all-MiniLM-L6-v2-shaped pair, a Llama-shaped 0.49 B
decoder with grouped-query attention in bf16 or float32: random weights, B a scrambled copy of A
so that every transform is estimated, accepted and applied) this runs, each in a fresh subprocess:

* **floor** — load A and B, two plain forward passes (A, then B) over the calibration batches,
  save one model with ``save_pretrained``;
* **merge** — the ``raot-hf merge`` equivalent through the Python API
  (``RaotMerger.from_pretrained(...).merge()`` then ``save_pretrained``), with per-stage times
  from ``report["timings"]``.

It reports wall time, the ratio merge/floor, the solve time (every assignment and SVD) and the
peak RSS (``VmHWM``) against the sum of the two checkpoints' sizes, writes
``benchmarks/perf/results.md`` and prints it. Not part of the test suite (minutes of CPU)::

    python benchmarks/perf/run.py                                    # both shapes, 128 examples
    python benchmarks/perf/run.py --examples 512 --moment-strides 1,8  # the product's default size;
                                                                     # all tokens, and every 8th
    python benchmarks/perf/run.py --shapes minilm-l6                 # one shape
    python benchmarks/perf/run.py --shapes bert-base --merge-rules linear,regmean  # the two rules
    python benchmarks/perf/run.py --examples 512 --moment-precisions auto,float32 --budgets 0,16 --repeat 2

Time is wall-clock on a shared machine: run it when the machine is quiet (the report prints
the load average) and with ``--repeat 2`` or more.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

try:  # run as a script (python benchmarks/perf/run.py) or as a module
    from benchmarks.records import append_run, provenance, render_blocks, run_heading
except ImportError:  # pragma: no cover
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.records import append_run, provenance, render_blocks, run_heading

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

SHAPES = {
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "minilm-l6": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    # a Llama-shaped decoder of ~0.49 B parameters with grouped-query attention, bf16 on disk and in memory
    "llama-0.5b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=4096,
        family="llama",
        dtype="bfloat16",
    ),
}
# the same in float32 (CPUs without fast bf16 kernels: there bf16 forwards are several times slower)
SHAPES["llama-0.5b-fp32"] = {**SHAPES["llama-0.5b"], "dtype": "float32"}
# four of its layers: per-layer costs and memory of the 0.49 B shape in a fraction of the time
SHAPES["llama-0.5b-fp32-4l"] = {**SHAPES["llama-0.5b-fp32"], "num_hidden_layers": 4}
# the same with B a scrambled copy of A moved by 5 % noise: the merge is not A, so the correction
# refits every Linear (an exact symmetry refits none) — what a merge of two different models costs
SHAPES["llama-0.5b-fp32-4l-drift"] = {**SHAPES["llama-0.5b-fp32-4l"], "drift": 0.05}
# a 24-layer Llama-shaped decoder that computes like a trained one (raot_hf.testing.trained_like):
# unit-gain weights, peaked attention, and massive activations (~10³ on the first and last token
# of every text, against a median stream entry of ~1); the merge must give A back
SHAPES["llama-24l-massive"] = dict(
    hidden_size=512,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=1408,
    family="llama",
    dtype="float32",
    trained_like={"massive": 1000.0},
)
# stands in for real small LLMs (a 135 M-parameter Llama-family shape: 30 layers, d 576, 9 query /
# 3 KV heads, SwiGLU f 1,536), computing like a trained one: massive activations and a pair of
# near-twin massive MLP units of different magnitude (raot_hf.testing.trained_like's twins)
SHAPES["llama-135m-like"] = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    family="llama",
    dtype="float32",
    trained_like={"massive": 1000.0, "twins": 300.0},
)
# the shape of a real 135 M-parameter Llama-family LLM as it is merged: SmolLM2-135M's (30 layers,
# d 576, 9 query / 3 KV heads, f 1,536) with its causal-LM head tied to a 49,152-token embedding,
# computing like a trained one (massive activations, near-twin MLP units), calibrated on texts of
# varied length (uniform between an eighth of --seq and --seq tokens, as short reviews are) — the
# head's 49,152-way products and the padding of varied texts are part of what a merge costs
SHAPES["llama-135m-lm"] = dict(
    SHAPES["llama-135m-like"], head="causal", tie_word_embeddings=True, vocab=49152, lengths="varied"
)
# a classifier the default refit runs on (≤ 50 M parameters, a classification head): the
# all-MiniLM-L6-v2 trunk (6 layers, d 384, 12 heads, f 1,536) with a two-label head, computing like
# a trained one (unit-gain weights: confident predictions); B a scrambled copy of A moved by 5 %
# noise, so that the merge is not A and the refit has something to follow
SHAPES["bert-6l-sequence"] = dict(
    SHAPES["minilm-l6"], head="sequence", num_labels=2, drift=0.05, dtype="float32", trained_like={}
)
VOCAB = 30522
#: Targets: merge / floor per shape (docs/design.md §7.2; shapes not listed have none); the stages
#: after the solve ≤ 2 × the floor; solve ≤ 10 s (bert-base, 2 cores); peak RSS ≤ 3 × (A + B) in
#: memory and ≤ 0.5 × (A + B) layer by layer (the models in working files, §7.4).
TARGET_RATIO = {
    "bert-base": 1.6,
    "llama-135m-like": 5.0,
    "llama-135m-lm": 3.0,
    "llama-0.5b": 2.5,
    "llama-0.5b-fp32": 2.5,
    "bert-6l-sequence": 3.0,
}
#: The merge / floor targets a record made before its run stored them was rendered against.
EARLIER_TARGET_RATIO = {"bert-base": 1.8, "llama-135m-like": 5.0, "llama-0.5b": 2.5, "llama-0.5b-fp32": 2.5}
#: The model class of each head (the floor loads what the merge loads).
HEAD_CLASSES = {None: "AutoModel", "causal": "AutoModelForCausalLM", "sequence": "AutoModelForSequenceClassification"}
TARGET_AFTER_SOLVE, TARGET_SOLVE_S, TARGET_RSS, TARGET_RSS_LAYERWISE = 2.0, 10.0, 3.0, 0.5
#: The stages after the solve: the gate (its capture included), the apply and the correction as
#: three passes, or the one sweep that does all three (docs/design.md §5.7).
AFTER_SOLVE = ("gate", "apply", "correction", "sweep")


# ------------------------------------------------------------------------------ measurement


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class RssSampler:
    """Samples the resident set every ``interval`` s and keeps the peak per labelled stage.

    The process-wide peak comes from the kernel (``VmHWM``), which misses nothing; per-stage
    peaks are sampled and may miss spikes shorter than the interval."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.stage, self.peaks, self.anon_peak, self.anon_peaks = interval, "start", {}, 0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            rss = _status_kib("VmRSS") * 1024
            self.peaks[self.stage] = max(self.peaks.get(self.stage, 0), rss)
            # anonymous memory only: an offloaded model's weights are file pages the kernel may drop
            anon = _status_kib("RssAnon") * 1024
            self.anon_peak = max(self.anon_peak, anon)
            self.anon_peaks[self.stage] = max(self.anon_peaks.get(self.stage, 0), anon)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _calibration_config(args):
    from raot_hf.calibration import CalibrationConfig

    return CalibrationConfig(
        source=str(Path(args.workdir) / "calibration.jsonl"),
        num_samples=args.examples,
        max_length=args.seq,
        batch_size=args.batch_size,
        moment_stride=args.moment_stride,
        moment_precision=args.moment_precision,
        mlp_tokens_per_unit=args.mlp_tokens_per_unit,
        mlp_cross_tokens=args.mlp_cross_tokens,
        hidden_cross_tokens=args.hidden_cross_tokens,
    )


def worker_floor(args) -> dict:
    """Load A and B, run both over the calibration batches, save A: the cost floor."""
    import torch
    import transformers

    from raot_hf.calibration import iter_calibration_batches, load_calibration_dataset

    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    times, rss_import = {}, _status_kib("VmRSS") * 1024
    with RssSampler() as sampler:
        start = time.perf_counter()
        sampler.stage = "load"
        tokenizer = transformers.AutoTokenizer.from_pretrained(work / "A")
        auto = getattr(transformers, HEAD_CLASSES[_shape_of(work).get("head")])
        model_a = auto.from_pretrained(work / "A", dtype="auto").eval()
        model_b = auto.from_pretrained(work / "B", dtype="auto").eval()
        times["load"] = time.perf_counter() - start
        sampler.stage, t = "forward", time.perf_counter()
        cal = _calibration_config(args)
        dataset = load_calibration_dataset(cal, config=cal)
        tokens = 0
        with torch.no_grad():
            for batch in iter_calibration_batches(dataset, tokenizer, cal):
                model_a(**batch.inputs)
                model_b(**batch.inputs)
                tokens += int(batch.token_mask.sum())
        times["forward"] = time.perf_counter() - t
        sampler.stage, t = "write", time.perf_counter()
        with tempfile.TemporaryDirectory(dir=work) as out:
            model_a.save_pretrained(out)
            tokenizer.save_pretrained(out)
        times["write"] = time.perf_counter() - t
        total = time.perf_counter() - start
    return {
        "total_s": total,
        "cpu_s": time.process_time(),
        "timings": times,
        "tokens": tokens,
        "peak_rss": _status_kib("VmHWM") * 1024,
        "rss_after_import": rss_import,
        "stage_rss": sampler.peaks,
    }


def _correction(spec: str) -> dict:
    """``lsq`` → {"method": "lsq"}; ``lsq:384`` → the same on 384 fit examples; ``auto@16``: the
    default, 16 fit examples per forward (the fit in chunks)."""
    spec, _, batch = spec.partition("@")
    method, _, examples = spec.partition(":")
    return {
        "method": method,
        **({"examples": int(examples)} if examples else {}),
        **({"batch_size": int(batch)} if batch else {}),
    }


def worker_merge(args) -> dict:
    """The ``raot-hf merge`` equivalent through the API, with per-stage times and memory."""
    import torch

    from raot_hf import RaotConfig, RaotMerger
    from raot_hf.calibration.statistics import SplitStatistics, quadratic_dtype

    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    rss_import = _status_kib("VmRSS") * 1024
    with RssSampler() as sampler:
        start = time.perf_counter()
        sampler.stage = "load"
        config = RaotConfig(
            calibration=_calibration_config(args),
            merge_rule=args.merge_rule,
            correction=_correction(args.correction),
            gate={"sweep": args.gate_sweep == "on"},
        )
        merger = RaotMerger.from_pretrained(work / "A", work / "B", config=config, offload=args.offload)
        timer_stage = merger.timer.stage

        def labelled_stage(name):  # label the sampler with the merger's own stage names
            sampler.stage = name
            return timer_stage(name)

        merger.timer.stage = labelled_stage
        result = merger.merge()
        sampler.stage, written = "write", time.perf_counter()
        with tempfile.TemporaryDirectory(dir=work) as out:
            result.save_pretrained(Path(out) / "merged")
        write_seconds = time.perf_counter() - written
        total = time.perf_counter() - start
    peak = _status_kib("VmHWM") * 1024
    recovery = _recovery(work, result.model, args)  # after the peak: it loads A once more
    quad = quadratic_dtype(next(merger.model_a.parameters()).dtype)
    stats_bytes = sum(
        t.numel() * t.element_size() for t in SplitStatistics.zeros(merger.schema, quad_dtype=quad).tensors()
    )
    modules = dict(merger.model_a.named_modules())
    # RegMean: one k×k Gram per Linear input, for A and for B, in the k×k sums' precision.
    gram_entries = sum(modules[mod].in_features ** 2 for layer in merger.schema.layers for mod in layer.linears)
    gram_bytes = 2 * gram_entries * torch.empty((), dtype=quad).element_size() if args.merge_rule == "regmean" else 0
    return {
        "merge_rule": args.merge_rule,
        "gram_bytes": gram_bytes,
        "total_s": total,
        "cpu_s": time.process_time(),
        "timings": {**result.report["timings"], "write": write_seconds},
        "tokens": int(result.report["calibration"]["fit_tokens"] + result.report["calibration"]["heldout_tokens"]),
        "moment_tokens": int(result.report["calibration"]["moment_tokens"]),
        "moment_precision": result.report["calibration"].get("moment_precision"),
        "mlp_moment_tokens": result.report["calibration"].get("mlp_moment_tokens"),
        "hidden_moment_tokens": result.report["calibration"].get("hidden_moment_tokens"),
        "applied": sum(d["applied"] for d in result.report["decisions"]),
        "decisions": len(result.report["decisions"]),
        "deviation": result.report["checks"][0]["value"],
        "recovery": recovery,
        "recovery_output": "last hidden state" if _shape_of(work).get("head") is None else "scores",
        "refit": {k: v for k, v in (result.report.get("refit") or {}).items() if k != "curve"},
        "correction": ((result.report.get("merge") or {}).get("correction") or {}).get("method", "none"),
        "correction_spec": args.correction,
        "peak_rss": peak,
        "rss_after_import": rss_import,
        "stage_rss": sampler.peaks,
        "peak_anon": sampler.anon_peak,
        "stage_anon": sampler.anon_peaks,
        "offload": args.offload,
        "execution": result.report.get("execution"),
        "statistics_bytes": stats_bytes,
    }


def _shape_of(work: Path) -> dict:
    """The settings of the shape prepared in ``work``."""
    return SHAPES[json.loads((work / "prepared.json").read_text())["shape"]]


def _primary(out):
    """A model output's primary tensor: the last hidden state, else the scores."""
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


def _recovery(work: Path, merged, args) -> float | None:
    """B = scramble(A), so the merge must be A: max |merged − A| / max |A| of the last hidden
    state (the merged stream is in A's basis; the scores of a model with a head) over the first
    calibration texts' real tokens. None where B is a drifted scramble (the merge is not A)."""
    import torch
    import transformers

    from raot_hf.calibration import iter_calibration_batches, load_calibration_dataset

    shape = _shape_of(work)
    if shape.get("drift"):
        return None
    auto = getattr(transformers, HEAD_CLASSES[shape.get("head")])
    reference = auto.from_pretrained(work / "A", dtype="auto").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(work / "A")
    cal = _calibration_config(args)
    batch = next(iter_calibration_batches(load_calibration_dataset(cal, config=cal), tokenizer, cal))
    inputs = {k: v[:4] for k, v in batch.inputs.items()}
    mask = batch.token_mask[:4]
    with torch.no_grad():
        ref, got = _primary(reference(**inputs)), _primary(merged(**inputs))
    if ref.dim() == 3:  # per token: the real ones
        ref, got = ref[mask], got[mask]
    ref, got = ref.double(), got.double()
    return float((got - ref).abs().max() / ref.abs().max())


# ----------------------------------------------------------------------------------- setup


def _random_model(shape: str):
    """A randomly initialised base model of ``shape`` (BERT unless the shape names a family)."""
    import torch
    import transformers

    settings = dict(SHAPES[shape])
    family, dtype = settings.pop("family", "bert"), settings.pop("dtype", "float32")
    behaviour = settings.pop("trained_like", None)
    head, vocab = settings.pop("head", None), settings.pop("vocab", VOCAB)
    for key in ("lengths", "drift"):
        settings.pop(key, None)
    if family == "llama":
        settings.setdefault("tie_word_embeddings", False)
        config = transformers.LlamaConfig(vocab_size=vocab, **settings)
    else:
        config = transformers.BertConfig(vocab_size=vocab, **settings)
    model = getattr(transformers, HEAD_CLASSES[head]).from_config(config)
    if behaviour is not None:
        from raot_hf.testing import trained_like

        trained_like(model.double(), **behaviour)
    return model.to(getattr(torch, dtype)).eval()


def prepare(workdir: Path, shape: str, examples: int, seq: int, seed: int = 0) -> None:
    """Random A, B = scramble(A) (safetensors), a shared tokenizer and a synthetic calibration set."""
    import torch

    from raot_hf import scramble
    from raot_hf.testing import scrambled_near_copy, tiny_tokenizer

    workdir.mkdir(parents=True, exist_ok=True)
    marker = workdir / "prepared.json"
    spec = {"shape": shape, "examples": examples, "seq": seq, "seed": seed}
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return
    torch.manual_seed(seed)
    model = _random_model(shape)
    settings = SHAPES[shape]
    vocab = settings.get("vocab", VOCAB)
    tokenizer = tiny_tokenizer(vocab)
    model.save_pretrained(workdir / "A")
    tokenizer.save_pretrained(workdir / "A")
    if settings.get("drift"):  # a scrambled copy moved by noise: the merge is not A, the refit runs
        model = scrambled_near_copy(model, seed=seed + 1, noise=settings["drift"])
    else:
        scramble(model, seed=seed + 1)
    model.save_pretrained(workdir / "B")
    tokenizer.save_pretrained(workdir / "B")
    g = torch.Generator().manual_seed(seed)
    varied = settings.get("lengths") == "varied"
    with open(workdir / "calibration.jsonl", "w") as fh:
        for _ in range(examples):
            length = int(torch.randint(max(3, seq // 8), seq + 1, (1,), generator=g)) if varied else seq
            ids = torch.randint(5, vocab, (length - 2,), generator=g).tolist()  # + [CLS] … [SEP] = length tokens
            fh.write(json.dumps({"text": " ".join(f"w{i}" for i in ids)}) + "\n")
    marker.write_text(json.dumps(spec))


def _checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _run_worker(kind: str, args, workdir: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--workdir", str(workdir)]
    cmd += ["--examples", str(args.examples), "--seq", str(args.seq), "--batch-size", str(args.batch_size)]
    cmd += ["--threads", str(args.threads), "--moment-stride", str(args.moment_stride)]
    cmd += ["--merge-rule", args.merge_rule, "--moment-precision", args.moment_precision]
    cmd += ["--mlp-tokens-per-unit", str(args.mlp_tokens_per_unit), "--correction", args.correction]
    cmd += ["--mlp-cross-tokens", str(args.mlp_cross_tokens), "--hidden-cross-tokens", str(args.hidden_cross_tokens)]
    cmd += ["--offload", args.offload, "--gate-sweep", args.gate_sweep]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if args.malloc_mmap_threshold:  # glibc: blocks this large are mapped and unmapped, never kept in its heap
        env["MALLOC_MMAP_THRESHOLD_"] = env["MALLOC_TRIM_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{kind} worker failed with exit code {proc.returncode}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


# ---------------------------------------------------------------------------------- report


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _recovered(value: float | None) -> str:
    return "– (B is a drifted scramble: the merge is not A)" if value is None else f"{value:.1e}"


def _verdict(name: str, value: float, target: float, unit: str) -> str:
    return f"{name} {value:.2f}{unit} (target ≤ {target}{unit}: {'met' if value <= target else 'missed'})"


def render(results: dict, run: dict) -> list[str]:
    """The markdown of one run's record (its settings and provenance in ``run``), without a title."""
    lines = [
        f"Command: `{run['command']}`  ",
        f"Machine: {run['machine']} with {run['threads']} threads; load average at start {run['load']:.2f}.  ",
        f"Calibration: {run['examples']} examples × {run['seq']} tokens (synthetic), batch size {run['batch_size']}; "
        "B = scramble(A), so every transform is estimated, accepted and applied. "
        f"Each kind ran {run['repeat']}× (alternating floor and merge); the fastest run is shown.",
        "",
        "| shape | floor (s) | merge (s) | merge / floor | CPU-time ratio | solve (s) | peak RSS merge "
        "| peak RSS floor | A + B | RSS / (A + B) | statistics | RegMean Grams (A and B) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, r in results.items():
        if shape.startswith("_"):
            continue
        f, m, size = r["floor"], r["merge"], r["size"]
        lines.append(
            f"| {shape} | {f['total_s']:.1f} | {m['total_s']:.1f} | {m['total_s'] / f['total_s']:.2f} "
            f"| {m['cpu_s'] / f['cpu_s']:.2f} | {m['timings'].get('solve', 0):.2f} | {_mib(m['peak_rss'])} "
            f"| {_mib(f['peak_rss'])} | {_mib(size)} "
            f"| {m['peak_rss'] / size:.2f} | {_mib(m['statistics_bytes'])} "
            f"| {_mib(m['gram_bytes']) if m.get('gram_bytes') else '–'} |"
        )
    lines += ["", "Per-stage times (s), sampled peak RSS and anonymous RSS (not backed by files) per stage:", ""]
    stages = ["load", "calibration", "solve", "gate", "apply", "refine", "merge", "correction", "sweep", "refit"]
    stages.append("write")
    used = {s for shape, r in results.items() if not shape.startswith("_") for s in r["merge"]["timings"]}
    stages = [s for s in stages if s not in ("sweep", "refit") or s in used]  # where a merge ran them
    lines += ["| shape | run | " + " | ".join(stages) + " | other |", "|---|---|" + "---|" * (len(stages) + 1)]
    for shape, r in results.items():
        if shape.startswith("_"):
            continue
        for kind in ("floor", "merge"):
            x = r[kind]
            t = dict(x["timings"])
            if kind == "floor":
                t["calibration"] = t.pop("forward")
            other = x["total_s"] - sum(t.values())
            cells = [f"{t[s]:.2f}" if s in t else "" for s in stages]
            lines.append(f"| {shape} | {kind} time | " + " | ".join(cells) + f" | {other:.2f} |")
            rss = x["stage_rss"]
            rss_cells = [_mib(rss[s]) if s in rss else "" for s in stages]
            if "forward" in rss:
                rss_cells[1] = _mib(rss["forward"])
            lines.append(f"| {shape} | {kind} RSS | " + " | ".join(rss_cells) + " | |")
            anon = x.get("stage_anon")
            if anon:
                anon_cells = [_mib(anon[s]) if s in anon else "" for s in stages]
                lines.append(f"| {shape} | {kind} anonymous | " + " | ".join(anon_cells) + " | |")
    lines += ["", "Targets:", ""]
    for shape, r in results.items():
        if shape.startswith("_"):
            continue
        f, m, size = r["floor"], r["merge"], r["size"]
        ratio, rss = m["total_s"] / f["total_s"], m["peak_rss"] / size
        base = r.get("base", shape)
        settings = SHAPES.get(base, {})
        after_solve = sum(m["timings"].get(s, 0.0) for s in AFTER_SOLVE)
        targets = run.get("targets", EARLIER_TARGET_RATIO)  # those in force when it ran
        checks = [_verdict("total/floor", ratio, targets[base], "")] if base in targets else []
        checks.append(_verdict("after the solve / floor", after_solve / f["total_s"], TARGET_AFTER_SOLVE, ""))
        if base == "bert-base":
            checks.append(_verdict("solve", m["timings"].get("solve", 0.0), TARGET_SOLVE_S, " s"))
        layerwise = m.get("execution", "layer-wise" if m.get("offload") == "always" else None) == "layer-wise"
        checks.append(_verdict("peak RSS / (A + B)", rss, TARGET_RSS_LAYERWISE if layerwise else TARGET_RSS, ""))
        lines.append(f"* {shape}: " + "; ".join(checks) + ".")
        if settings.get("lengths") == "varied" or settings.get("drift"):
            texts = f"texts of {max(3, run['seq'] // 8)}–{run['seq']} tokens" if settings.get("lengths") else ""
            drift = f"B a scrambled copy of A moved by {settings['drift']:.0%} noise" if settings.get("drift") else ""
            lines.append("  " + "; ".join(x for x in (texts, drift) if x).capitalize() + ".")
        if m.get("refit"):
            rf = m["refit"]
            lines.append(
                f"  Refit: {rf.get('steps', 0)} steps ({rf.get('budget', 'no budget')}), kept {rf.get('kept')} "
                f"({rf.get('reason', '')}); held-out loss {rf.get('heldout_loss_before')} → "
                f"{rf.get('heldout_loss_after')}; {m['timings'].get('refit', 0.0):.1f} s."
            )
        passes = "one sweep" if "sweep" in m["timings"] else "gate, apply and correction"
        lines.append(
            f"  After the solve ({passes}): {after_solve:.1f} s = {after_solve / f['total_s']:.2f} × the floor."
        )
        lines.append(
            f"  Merge: {m['applied']}/{m['decisions']} transforms applied, B′ ≡ B deviation {m['deviation']:.1e}, "
            f"merged vs A (relative, {m.get('recovery_output', 'last hidden state')}) "
            f"{_recovered(m.get('recovery', float('nan')))}, "
            f"post-merge correction {m.get('correction', 'none')}; "
            f"RSS after imports {_mib(m['rss_after_import'])}; peak RSS above it "
            f"{(m['peak_rss'] - m['rss_after_import']) / size:.2f} × (A + B) (floor: "
            f"{(f['peak_rss'] - f['rss_after_import']) / size:.2f} ×). All totals (s): {r['all_totals']}."
        )
        if m.get("peak_anon"):
            lines.append(
                f"  Sampled peak anonymous RSS (memory not backed by files) {_mib(m['peak_anon'])} = "
                f"{m['peak_anon'] / size:.2f} × (A + B); offload {m.get('offload', 'auto')}."
            )
        if m.get("moment_precision"):
            mp = m["moment_precision"]
            kept = m.get("mlp_moment_tokens") or []
            tokens = f", {min(kept):,}–{max(kept):,} of {m['moment_tokens']:,} fit tokens per layer" if kept else ""
            lines.append(
                f"  MLP cross moments: {mp['used']} products (requested {mp['requested']}; {mp['why']}){tokens}."
            )
        hidden = m.get("hidden_moment_tokens") or []
        if hidden:
            lines.append(
                f"  Query, key, context and stream cross moments: {min(hidden):,}–{max(hidden):,} of "
                f"{m['moment_tokens']:,} fit tokens per layer and site."
            )
    return lines


def render_history(history: dict, record_name: str) -> str:
    """The markdown of a history of runs (``benchmarks/records.py``): the latest run first, then the
    earlier ones, each with its provenance; runs recovered from earlier markdown as printed."""
    runs = history["runs"]
    lines = [f"# {history.get('title') or 'raot_hf performance benchmark'}", ""]
    lines += [
        f"Generated from the records in `{record_name}` by `python -m benchmarks.report_all` "
        f"({len(runs)} run(s), the latest first; do not edit by hand).",
        "",
    ]
    lines += render_blocks(history.get("notes", []))
    for i, run in enumerate(reversed(runs)):
        title = run.get("title") or ("Latest run" if i == 0 else "Earlier run")
        lines += [f"## {title}", "", run_heading(run), ""]
        if run.get("kind") == "transcribed":
            lines += render_blocks(run["blocks"])
        else:
            lines += render_blocks(run.get("notes_before", []))
            lines += render(run["results"], run)
            lines += render_blocks(run.get("notes", []))
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None) -> None:
    from raot_hf.calibration import CalibrationConfig

    defaults = CalibrationConfig()
    default_cap, default_hidden = defaults.mlp_cross_tokens, defaults.hidden_cross_tokens
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="bert-base,minilm-l6", help="comma list of: " + ", ".join(SHAPES))
    parser.add_argument("--examples", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--moment-strides", default="1", help="comma list: one merge run per calibration moment_stride (1 = all tokens)"
    )
    parser.add_argument("--moment-stride", type=int, default=1, help=argparse.SUPPRESS)  # for a worker
    parser.add_argument(
        "--merge-rules", default="linear", help="comma list: one merge run per merge rule (linear, regmean)"
    )
    parser.add_argument("--merge-rule", default="linear", help=argparse.SUPPRESS)  # for a worker
    parser.add_argument(
        "--moment-precisions",
        default="auto",
        help="comma list: one merge run per calibration moment_precision (auto, float32, bfloat16)",
    )
    parser.add_argument("--moment-precision", default="auto", help=argparse.SUPPRESS)  # for a worker
    parser.add_argument(
        "--budgets", default="0", help="comma list: one merge run per mlp_tokens_per_unit (0 = every token)"
    )
    parser.add_argument("--mlp-tokens-per-unit", type=int, default=0, help=argparse.SUPPRESS)  # for a worker
    parser.add_argument(
        "--cross-tokens",
        default="default",
        help="comma list: one merge run per mlp_cross_tokens (default = the calibration's default; 0 = every token)",
    )
    parser.add_argument("--mlp-cross-tokens", type=int, default=default_cap, help=argparse.SUPPRESS)
    parser.add_argument(
        "--hidden-tokens",
        dest="hidden_caps",
        default="default",
        help="comma list: one merge run per hidden_cross_tokens, the query, key, context and stream cross "
        "moments' cap (default = the calibration's default; 0 = every token)",
    )
    parser.add_argument("--hidden-cross-tokens", type=int, default=default_hidden, help=argparse.SUPPRESS)
    parser.add_argument(
        "--corrections",
        default="auto",
        help="comma list: one merge run per post-merge correction (auto, none, lsq, repair; lsq:384 = on 384 "
        "examples; auto@16 = 16 examples per forward)",
    )
    parser.add_argument("--correction", default="auto", help=argparse.SUPPRESS)  # for a worker
    parser.add_argument(
        "--gate-sweeps",
        default="on",
        help="comma list: one merge run with the one sweep after the solve (on, the default) and one with "
        "the gate, apply and correction as three passes (off)",
    )
    parser.add_argument("--gate-sweep", default="on", help=argparse.SUPPRESS)  # for a worker
    parser.add_argument(
        "--offload",
        default="auto",
        choices=["auto", "always", "never"],
        help="run the merge layer by layer with the models in working files (always), in memory (never), or "
        "whichever fits (auto)",
    )
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=0,
        help="bytes: run floor and merge with glibc's MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ set to "
        "this (allocations this large go back to the system when freed; 0: glibc's own adaptive threshold)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of each kind; the fastest is reported")
    parser.add_argument("--workdir", help="where models and data go (default: a temporary directory)")
    parser.add_argument("--out", default=str(HERE / "results.md"))
    parser.add_argument("--worker", choices=["floor", "merge"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker_floor(args) if args.worker == "floor" else worker_merge(args)
        print("RESULT " + json.dumps(result))
        return
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    results: dict = {"_load": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir) if args.workdir else Path(tmp)
        for shape in shapes:
            work = root / shape
            print(f"[{shape}] preparing {work}", file=sys.stderr)
            prepare(work, shape, args.examples, args.seq)
            size = _checkpoint_bytes(work / "A") + _checkpoint_bytes(work / "B")
            strides = [int(x) for x in args.moment_strides.split(",") if x]
            rules = [x for x in args.merge_rules.split(",") if x]
            precisions = [x for x in args.moment_precisions.split(",") if x]
            budgets = [int(x) for x in args.budgets.split(",") if x]
            caps = [default_cap if x == "default" else int(x) for x in args.cross_tokens.split(",") if x]
            hidden_caps = [default_hidden if x == "default" else int(x) for x in args.hidden_caps.split(",") if x]
            corrections = [x for x in args.corrections.split(",") if x]
            sweeps = [x for x in args.gate_sweeps.split(",") if x]
            if not set(sweeps) <= {"on", "off"}:
                parser.error(f"--gate-sweeps takes on and off, not {args.gate_sweeps!r}")
            variants = {}
            for s, rule, p, b, c, w, t, h in itertools.product(
                strides, rules, precisions, budgets, corrections, sweeps, caps, hidden_caps
            ):
                staged, capped = ("" if w == "on" else "-staged"), ("" if t == default_cap else f"-x{t}")
                capped += "" if h == default_hidden else f"-h{h}"
                variants[f"merge{s}-{rule}-{p}-{b}-{c}{staged}{capped}"] = (s, rule, p, b, c, w, t, h)
            kinds = ["floor", *variants]
            runs: dict[str, list] = {kind: [] for kind in kinds}
            for rep in range(args.repeat):  # alternate, so that load from other jobs hits all alike
                for kind in kinds:
                    print(f"[{shape}] {kind} ({rep + 1}/{args.repeat}) …", file=sys.stderr)
                    worker_args = argparse.Namespace(**vars(args))
                    if kind != "floor":
                        (
                            worker_args.moment_stride,
                            worker_args.merge_rule,
                            worker_args.moment_precision,
                            worker_args.mlp_tokens_per_unit,
                            worker_args.correction,
                            worker_args.gate_sweep,
                            worker_args.mlp_cross_tokens,
                            worker_args.hidden_cross_tokens,
                        ) = variants[kind]
                    x = _run_worker("floor" if kind == "floor" else "merge", worker_args, work)
                    x["load_average"] = os.getloadavg()[0]
                    runs[kind].append(x)
                    print(f"[{shape}] {kind}: {x['total_s']:.1f} s, peak {_mib(x['peak_rss'])}", file=sys.stderr)
            # the fastest run of each kind is the least disturbed by other jobs on the machine
            best = {kind: min(xs, key=lambda x: x["total_s"]) for kind, xs in runs.items()}
            for kind, (stride, rule, precision, budget, correction, sweep, cap, hidden) in variants.items():
                details = ([f"moment_stride={stride}"] if stride != 1 else []) + ([rule] if rule != "linear" else [])
                details += [f"moments {precision}"] if precision != "auto" else []
                details += [f"≤ {budget} tokens per MLP unit"] if budget else []
                if cap != default_cap:
                    details += [f"≤ {cap:,} tokens per MLP moment" if cap else "every fit token"]
                if hidden != default_hidden:
                    details += [f"≤ {hidden:,} tokens per d × d moment" if hidden else "every d × d moment token"]
                details += [f"correction {correction}"] if correction != "auto" else []
                details += ["gate, apply and correction as three passes"] if sweep == "off" else []
                details += [f"offload {args.offload}"] if args.offload != "auto" else []
                details += [f"malloc threshold {args.malloc_mmap_threshold:,} B"] if args.malloc_mmap_threshold else []
                label = ", ".join([shape, *details])
                results[label] = {
                    "floor": best["floor"],
                    "merge": best[kind],
                    "size": size,
                    "base": shape,
                    "all_totals": {k: [round(x["total_s"], 2) for x in runs[k]] for k in ("floor", kind)},
                }
    # append this run to the record beside --out (earlier runs are kept), then regenerate the markdown
    command = " ".join(["python", "benchmarks/perf/run.py", *(sys.argv[1:] if argv is None else argv)])
    run = provenance(command)
    run.update(
        kind="perf-run",
        threads=args.threads,
        examples=args.examples,
        seq=args.seq,
        batch_size=args.batch_size,
        repeat=args.repeat,
        malloc_mmap_threshold=args.malloc_mmap_threshold,
        load=results["_load"],
        targets=TARGET_RATIO,
        results=results,
    )
    record = Path(args.out).with_suffix(".json")
    history = append_run(record, run)
    text = render_history(history, record.name)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
