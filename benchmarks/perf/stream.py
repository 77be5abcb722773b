"""Memory and time of merges streamed from the checkpoints' files, against the in-memory merge.

Builds Llama-shaped checkpoints with random weights, written tensor by tensor (never a whole
model in memory): a base and ``--models`` drifts of it. Then, each in a fresh subprocess, merges
them with ``raot_hf.merge_checkpoints`` (``alignment="none"``: linear, or TIES against the base)
streamed and — unless ``--skip-in-memory`` — loaded in memory, and records wall time and peak RSS
(the kernel's ``VmHWM``). A few merged tensors are checked against the rule computed here
directly. Writes a markdown table::

    python benchmarks/perf/stream.py --shape llama-0.5b-fp32 --models 3 --rule ties --workdir /tmp/sw
    python benchmarks/perf/stream.py --shape llama-3.8b-fp32 --models 2 --skip-in-memory --workdir /data/sw
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
SHAPES = {
    "llama-0.5b-fp32": dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=4, intermediate_size=4096
    ),  # fmt: skip
    # ~3.8 B parameters: two of them in float32 (30 GB) exceed a 24 GiB machine's memory
    "llama-3.8b-fp32": dict(
        hidden_size=3072, num_hidden_layers=36, num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192
    ),  # fmt: skip
    # ~3.4 B parameters: two of them in float32 (27.5 GB) exceed a 24 GiB machine's memory too
    "llama-3.4b-fp32": dict(
        hidden_size=3072, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192
    ),  # fmt: skip
    # the 3.4 B shape's layers, four of them: its per-layer costs in minutes instead of an hour
    "llama-3.4b-fp32-4l": dict(
        hidden_size=3072, num_hidden_layers=4, num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192
    ),  # fmt: skip
    "llama-tiny-fp32": dict(  # for a quick check of the scripts
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
    ),  # fmt: skip
}
SHARD_BYTES = 2 * 10**9


def _config(shape: str):
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=512, dtype="float32", **SHAPES[shape])
    config.architectures = ["LlamaForCausalLM"]
    return config


def build(shape: str, out: Path, seed: int, base: Path | None = None, drift: float = 0.01) -> Path:
    """A checkpoint of ``shape`` (random weights, or ``base`` plus a drift: a fine-tune-like
    sibling), written tensor by tensor."""
    import safetensors.torch
    import torch
    import transformers
    from safetensors import safe_open

    if (out / "model.safetensors.index.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = _config(shape)
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM._from_config(config)
    g = torch.Generator().manual_seed(seed)
    shard, size, files, weight_map = {}, 0, [], {}
    base_files = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"] if base else {}

    def flush():
        nonlocal shard, size
        name = f"part-{len(files):05d}.safetensors"
        safetensors.torch.save_file(shard, str(out / name), metadata={"format": "pt"})
        files.append((name, list(shard)))
        shard, size = {}, 0

    for name, param in skeleton.state_dict().items():
        if base is not None:
            with safe_open(str(base / base_files[name]), framework="pt") as handle:
                origin = handle.get_tensor(name)
            tensor = origin + drift * origin.abs().mean() * torch.randn(origin.shape, generator=g)
        elif name.endswith("norm.weight"):
            tensor = torch.ones(param.shape)
        else:
            tensor = 0.02 * torch.randn(param.shape, generator=g)
        shard[name] = tensor
        size += tensor.numel() * 4
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    for i, (name, keys) in enumerate(files, start=1):
        final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        (out / name).rename(out / final)
        weight_map.update(dict.fromkeys(keys, final))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(out)
    return out


_CHILD = """
import json, sys, time
from raot_hf import merge_checkpoints
spec = json.loads(sys.argv[1])
start = time.perf_counter()
path, report = merge_checkpoints(*spec["models"], out=spec["out"], alignment="none", overwrite=True,
                                 stream=spec["stream"], **spec["options"])
seconds = time.perf_counter() - start
with open("/proc/self/status") as fh:
    peak = next(int(l.split()[1]) for l in fh if l.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "peak_kib": peak, "execution": report.get("execution", "in memory")}))
"""


def run_merge(models: list[Path], out: Path, stream: bool, options: dict) -> dict:
    """One merge in a fresh process: wall time, peak RSS, how it ran."""
    spec = json.dumps({"models": [str(m) for m in models], "out": str(out), "stream": stream, "options": options})
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, "-c", _CHILD, spec], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(models: list[Path], base: Path | None, out: Path, rule: str, names: list[str]) -> float:
    """Largest relative difference between merged tensors and the rule computed here on them."""
    import torch
    from safetensors import safe_open

    from raot_hf.merging import merge_linear, merge_ties

    def read(directory: Path, name: str) -> torch.Tensor:
        index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
        with safe_open(str(directory / index[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    worst = 0.0
    for name in names:
        states = [{name: read(m, name)} for m in models]
        weights = [1.0 / len(models)] * len(models)
        if rule == "ties":
            expected = merge_ties(states, weights, {name: read(base, name)})[name]
        else:
            expected = merge_linear(states, weights)[name]
        got = read(out, name)
        worst = max(worst, float((got - expected).abs().max() / expected.abs().max()))
    return worst


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-0.5b-fp32", choices=sorted(SHAPES))
    parser.add_argument("--models", type=int, default=2)
    parser.add_argument("--rule", default="linear", choices=("linear", "ties"))
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--skip-in-memory", action="store_true")
    parser.add_argument("--out", default=None, help="Markdown file to append the result to.")
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    started = time.perf_counter()
    base = build(args.shape, work / f"{args.shape}-base", seed=0) if args.rule == "ties" else None
    models = [build(args.shape, work / f"{args.shape}-m{i}", seed=i, base=base) for i in range(1, args.models + 1)]
    built = time.perf_counter() - started
    options = {"merge_rule": "ties", "base": str(base)} if base is not None else {}
    inputs = sum(_size(m) for m in models) + (_size(base) if base is not None else 0)
    rows = [("streamed", run_merge(models, work / "merged-stream", True, options))]
    if not args.skip_in_memory:
        rows.append(("in memory", run_merge(models, work / "merged-memory", False, options)))
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.13.mlp.down_proj.weight", "lm_head.weight"]
    deviation = check(models, base, work / "merged-stream", args.rule, names)
    import torch

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    lines = [
        f"\n### {args.shape}: {args.rule} of {args.models} checkpoints ({inputs / 1e9:.1f} GB read)\n",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {memory / 2**30:.1f} GiB RAM, "
        f"torch {torch.__version__}. "
        f"Command: `python benchmarks/perf/stream.py {' '.join(argv if argv is not None else sys.argv[1:])}`. "
        f"Checkpoints built in {built:.0f} s.\n",
        "| path | seconds | peak RSS | peak RSS / inputs | ran |",
        "|---|---|---|---|---|",
    ]
    for label, r in rows:
        if "error" in r:
            lines.append(f"| {label} | – | – | – | failed: {r['error']} |")
            continue
        peak = r["peak_kib"] * 1024
        lines.append(
            f"| {label} | {r['seconds']:.1f} | {peak / 2**20:,.0f} MiB | {peak / inputs:.3f} | {r['execution']} |"
        )
    lines.append(
        f"\nMerged tensors against the rule computed directly ({', '.join(names)}): "
        f"max relative difference {deviation:.1e}.\n"
    )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
