"""An aligned merge of two checkpoints larger than memory together, run layer by layer.

Builds a Llama-shaped checkpoint A with random weights (written tensor by tensor) and B =
scramble(A) (A loaded alone, scrambled in place, saved), a word tokenizer and a synthetic
calibration set. Then, in a fresh process, ``raot_hf.merge_checkpoints(A, B)`` with the default
options — the in-memory merge would not fit, so the models are offloaded and run layer by layer —
and records wall time, the stages' times, peak RSS (the kernel's ``VmHWM``, which counts the
working files' resident pages) and the sampled peak of anonymous memory. Last, in another
process, the merged model's logits against A's on a few prompts (one model in memory at a time):
B is an exact symmetry of A, so the merge must give A back::

    python benchmarks/perf/layerwise.py --shape llama-3.4b-fp32 --workdir /data/lw \
        --out benchmarks/perf/results_layerwise.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.perf.stream import SHAPES, _size, build  # noqa: E402

VOCAB = 32000


def build_pair(shape: str, work: Path, examples: int, seq: int) -> tuple[Path, Path, Path]:
    """A (random, tensor by tensor), B = scramble(A), and the calibration file; reused when present."""
    a = build(shape, work / f"{shape}-A", seed=0)
    b = work / f"{shape}-B"
    if not (b / "model.safetensors.index.json").is_file() and not (b / "model.safetensors").is_file():
        code = (  # A read into a working file, scrambled in place and written shard by shard: never in memory
            "import sys, pathlib\n"
            "from raot_hf import scramble\n"
            "from raot_hf.io.loading import ModelSource, load_config, model_class\n"
            "from raot_hf.io.offload import WorkingFiles, load_offloaded\n"
            "from raot_hf.outputs.shards import weights_to_save, write_safetensors_shards\n"
            "from raot_hf.testing import tiny_tokenizer\n"
            "a, b = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])\n"
            "config = load_config(ModelSource(str(a)), 'A')\n"
            "files = WorkingFiles()\n"
            "model = load_offloaded(model_class(config), a, config, 'auto', a.parent, 'A', files)\n"
            "scramble(model, seed=1, working_files=files)\n"
            "b.mkdir(parents=True, exist_ok=True)\n"
            "write_safetensors_shards(b, weights_to_save(model, files), 2 * 10**9, working_files=files)\n"
            "config.save_pretrained(b)\n"
            f"for d in (a, b): tiny_tokenizer({VOCAB}).save_pretrained(d)\n"
        )
        subprocess.run([sys.executable, "-c", code, str(a), str(b)], check=True, cwd=ROOT)
    calibration = work / f"calibration-{examples}x{seq}.jsonl"
    if not calibration.is_file():
        import random

        rng = random.Random(0)
        with open(calibration, "w") as fh:
            for _ in range(examples):
                fh.write(json.dumps({"text": " ".join(f"w{rng.randrange(5, VOCAB)}" for _ in range(seq - 2))}) + "\n")
    return a, b, calibration


_MERGE = """
import json, sys, threading, time
spec = json.loads(sys.argv[1])

def kib(field):
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith(field + ":"))

peak_anon, stage_anon, stage, done = [0], {}, ["load"], threading.Event()
def sample():
    while not done.is_set():
        anon = kib("RssAnon")
        peak_anon[0] = max(peak_anon[0], anon)
        stage_anon[stage[0]] = max(stage_anon.get(stage[0], 0), anon)
        done.wait(0.05)
threading.Thread(target=sample, daemon=True).start()
from raot_hf.stages.context import StageTimer
timer_stage = StageTimer.stage
def labelled_stage(self, name):  # the sampler labelled with the merge's own stage names
    stage[0] = name
    return timer_stage(self, name)
StageTimer.stage = labelled_stage
from raot_hf import RaotConfig, merge_checkpoints
from raot_hf.calibration import CalibrationConfig
calibration = CalibrationConfig(source=spec["calibration"], num_samples=spec["examples"], max_length=spec["seq"],
                                batch_size=spec["batch_size"])
start = time.perf_counter()
path, report = merge_checkpoints(spec["a"], spec["b"], out=spec["out"], overwrite=True,
                                 config=RaotConfig(calibration=calibration), offload=spec["offload"],
                                 offload_dir=spec["offload_dir"])
seconds = time.perf_counter() - start
done.set()
applied = sum(d["applied"] for d in report["decisions"])
print(json.dumps({"seconds": seconds, "peak_kib": kib("VmHWM"), "peak_anon_kib": peak_anon[0],
                  "stage_anon_kib": stage_anon,
                  "execution": report["execution"], "timings": report["timings"],
                  "applied": applied, "decisions": len(report["decisions"]),
                  "check": report["checks"][0]["value"], "verdict": report["verdict"]}))
"""

_LOGITS = """
import json, sys, torch, transformers
spec = json.loads(sys.argv[1])
tok = transformers.AutoTokenizer.from_pretrained(spec["a"])
texts = [json.loads(l)["text"] for l in open(spec["calibration"])][: spec["prompts"]]
enc = tok(texts, return_tensors="pt", truncation=True, max_length=32, padding=True)
out = {}
for key in ("a", "merged"):
    model = transformers.LlamaForCausalLM.from_pretrained(spec[key], dtype=torch.float32).eval()
    with torch.no_grad():
        out[key] = model(**enc).logits[enc["attention_mask"].bool()].double()
    del model
ref, got = out["a"], out["merged"]
print(json.dumps({"relative": float((got - ref).abs().max() / ref.abs().max())}))
"""


def _child(code: str, spec: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"child failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.4b-fp32", choices=sorted(SHAPES))
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--offload", default="auto", choices=("auto", "always", "never"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--out", default=None, help="Markdown file to append the result to.")
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    a, b, calibration = build_pair(args.shape, work, args.examples, args.seq)
    built = time.perf_counter() - started
    merged, offload_dir = work / "merged", work / "offload"
    offload_dir.mkdir(exist_ok=True)
    spec = {"a": str(a), "b": str(b), "out": str(merged), "calibration": str(calibration), "offload": args.offload,
            "offload_dir": str(offload_dir), "examples": args.examples, "seq": args.seq,
            "batch_size": args.batch_size}  # fmt: skip
    result = _child(_MERGE, spec)
    logits = _child(_LOGITS, {"a": str(a), "merged": str(merged), "calibration": str(calibration),
                              "prompts": args.prompts})  # fmt: skip
    import torch

    inputs = _size(a) + _size(b)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    peak, anon = result["peak_kib"] * 1024, result["peak_anon_kib"] * 1024
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in result["timings"].items() if v >= 0.5)
    command = " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join(
        [
            f"\n### {args.shape}: aligned merge of A and B = scramble(A), {inputs / 1e9:.1f} GB together\n",
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {memory / 2**30:.1f} GiB RAM, torch "
            f"{torch.__version__}. Command: `python benchmarks/perf/layerwise.py {command}`. "
            f"Calibration: {args.examples} examples × {args.seq} tokens, batch size {args.batch_size}; "
            f"checkpoints built in {built:.0f} s.\n",
            "| ran | seconds | peak RSS (VmHWM) | peak anonymous RSS | A + B | transforms applied | B′ ≡ B | "
            "merged vs A (logits) |",
            "|---|---|---|---|---|---|---|---|",
            f"| {result['execution']} | {result['seconds']:.0f} | {peak / 2**30:.2f} GiB ({peak / inputs:.2f} ×) | "
            f"{anon / 2**30:.2f} GiB ({anon / inputs:.2f} ×) | {inputs / 2**30:.1f} GiB | "
            f"{result['applied']}/{result['decisions']} | {result['check']:.1e} | {logits['relative']:.1e} |",
            f"\nStages: {stages}. Verdict: {result['verdict']}\n",
            "Peak anonymous memory per stage (sampled every 50 ms): "
            + ", ".join(f"{k} {v / 2**20:.1f} GiB" for k, v in result.get("stage_anon_kib", {}).items())
            + ".\n",
        ]
    )
    print(text)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
