"""The ``raot-hf`` command line: a thin layer that builds the same :class:`RaotConfig` the
Python API takes (``merge``, ``inspect``, ``push``, ``demo``, ``selfcheck``)."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import click

from raot_hf.cli.demo import demo
from raot_hf.cli.errors import friendly_errors
from raot_hf.cli.push import push
from raot_hf.config import RaotConfig
from raot_hf.config.options import CliOption, cli_options
from raot_hf.errors import RaotError
from raot_hf.version import __version__

logger = logging.getLogger("raot_hf.cli")


def _quiet() -> bool:
    """True under ``raot-hf -q``: a successful command prints nothing."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx and ctx.meta.get("raot_hf.quiet"))


def _config_option(option: CliOption):
    """The click option of one RaotConfig field (booleans as ``--x/--no-x``, default None so
    that only explicit flags override a --config file)."""
    if option.kind is bool:
        return click.option(f"{option.flag}/--no-{option.flag[2:]}", option.dest, default=None, help=option.help)
    kind = click.Choice(list(option.choices)) if option.choices else {int: int, float: float}.get(option.kind)
    return click.option(option.flag, option.dest, type=kind, help=option.help)


def merge_options(fn):
    """Options shared by ``merge`` and ``inspect``: every field of RaotConfig (generated from
    its dataclasses), then the options that are not part of the config."""
    opts = [
        click.argument("models", nargs=-1),
        click.option(
            "--config",
            "config_file",
            type=click.Path(dir_okay=False),
            help="A merge file (mergekit-style YAML/JSON: models, merge_method, raot:) or a RaotConfig JSON; "
            "flags override it.",
        ),
        *(_config_option(option) for option in cli_options(RaotConfig)),
        click.option("--revision", help="Revision of A (and of B unless --revision-b)."),
        click.option("--revision-b", help="Revision of B."),
        click.option("--token", help="Hub token (default: HF_TOKEN or the login cache)."),
        click.option(
            "--trust-remote-code", is_flag=True, help="Allow custom model code from the Hub (off by default)."
        ),
        click.option("--allow-pickle", is_flag=True, help="Allow pickle (.bin) checkpoints (off by default)."),
        click.option("--debug", is_flag=True, help="Show tracebacks."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _read_config_file(name: str):
    """The ``--config`` file ``name``: a :class:`~raot_hf.config.mergefile.MergeFile` (models, base,
    options) or a RaotConfig JSON; unreadable files are a one-line error."""
    from raot_hf.config.mergefile import check_layer_range, looks_like_merge_file, parse_text, read_merge_file

    path = Path(name)
    if not path.is_file():
        raise RaotError(f"--config {path} does not exist; pass a merge file (YAML) or a RaotConfig JSON")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise RaotError(f"--config {path} cannot be read ({reason}); pass a merge file or a RaotConfig JSON") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RaotError(f"options are not valid JSON ({exc.msg} at line {exc.lineno}); fix the file") from None
    else:
        data = parse_text(text, str(path))
    if looks_like_merge_file(data):
        merge_file = read_merge_file(data)
        check_layer_range(merge_file)
        return merge_file
    if not isinstance(data, dict):
        raise RaotError(f"--config {path} must hold a mapping (a merge file or RaotConfig options)")
    return RaotConfig.from_dict(data)


def _config_and_models(options: dict) -> tuple[RaotConfig, list[str], str | None]:
    """The config, the models (command line or merge file) and the base (--base or base_model:)."""
    from raot_hf.config.mergefile import MergeFile

    loaded = _read_config_file(options["config_file"]) if options.get("config_file") else RaotConfig()
    models, base = list(options.get("models") or ()), options.get("base")
    if isinstance(loaded, MergeFile):
        if models:
            raise RaotError("the merge file lists the models; do not also give them on the command line")
        if base and loaded.base and base != loaded.base:
            raise RaotError(f"--base {base} differs from the merge file's base_model: {loaded.base}; give one")
        models, base, loaded = loaded.models, base or loaded.base, loaded.config
    if len(models) < 2:
        raise RaotError(f"give at least two models (got {len(models)}): raot-hf merge A B [C ...] --out DIR")
    return build_config(options, loaded), models, base


def build_config(options: dict, base: RaotConfig | None = None) -> RaotConfig:
    """The RaotConfig these CLI options describe (the same object the Python API takes): ``base``
    (the --config file's options, or the defaults), with every flag given on the command line set on top."""
    if base is None:
        base = _read_config_file(options["config_file"]) if options.get("config_file") else RaotConfig()
        base = getattr(base, "config", base)
    data = base.to_dict()
    for option in cli_options(RaotConfig):
        value = options.get(option.dest)
        if value is None:
            continue
        *sections, name = option.path
        target = data
        for section in sections:
            target = target[section]
        target[name] = value
    return RaotConfig.from_dict(data)


def _merger(options: dict, resolved: tuple | None = None, memory: dict | None = None):
    """The RaotMerger the options describe; ``resolved``: their (config, models, base) if already read;
    ``memory``: the offload options (:meth:`RaotMerger.from_pretrained`)."""
    from raot_hf.merger import RaotMerger

    config, models, base = resolved or _config_and_models(options)
    if config.needs_calibration and config.calibration.source is None:  # refused before any weights load
        raise RaotError("this merge needs calibration data; pass --calibration (or --alignment none)")
    if len(models) > 2 and options.get("_two_only"):
        raise RaotError(f"inspect compares two models, got {len(models)}; inspect each pair, or merge them all")
    return RaotMerger.from_pretrained(
        *models,
        config=config,
        revision=options.get("revision"),
        revision_b=options.get("revision_b"),
        token=options.get("token"),
        trust_remote_code=options.get("trust_remote_code", False),
        allow_pickle=options.get("allow_pickle", False),
        **({"base": base, "base_revision": options.get("base_revision")} if base else {}),
        **(memory or {}),
    )


class _LiveCommands(click.Group):
    """``merge`` and ``inspect`` are built when invoked, from the registries as they are then: a merge
    rule or estimator registered after import (with its own options section) has its choice and flags."""

    def get_command(self, ctx, name):
        builder = _LIVE_COMMANDS.get(name)
        return builder() if builder is not None else super().get_command(ctx, name)

    def list_commands(self, ctx):
        return sorted({*super().list_commands(ctx), *_LIVE_COMMANDS})


@click.group(cls=_LiveCommands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="raot-hf")
@click.option("-v", "--verbose", count=True, help="Every INFO log line (-vv: debug).")
@click.option("-q", "--quiet", is_flag=True, help="Errors only: no stage lines, progress bars or results.")
@click.pass_context
def main(ctx: click.Context, verbose: int, quiet: bool) -> None:
    """Merge two Transformer checkpoints after aligning them under exact symmetries (RaOT)."""
    from raot_hf.cli.verbosity import configure

    ctx.meta["raot_hf.quiet"] = quiet
    ctx.call_on_close(configure(verbose, quiet))


def _merge_command() -> click.Command:
    """``raot-hf merge``, built from the live registries."""

    @click.command("merge")
    @merge_options
    @click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
    @click.option("--base", help="The checkpoint A and B were fine-tuned from (task_arithmetic, ties, dare_ties).")
    @click.option("--base-revision", help="Revision of --base.")
    @click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
    @click.option("--max-shard-size", default="2GB", show_default=True)
    @click.option(
        "--stream/--no-stream",
        default=True,
        help="Merges that read no data (no alignment, a per-tensor rule) of local safetensors checkpoints are "
        "streamed from the files tensor by tensor (default); --no-stream loads the models. Same bytes either way.",
    )
    @click.option(
        "--max-memory",
        help="Cap on the process's memory, e.g. 8GiB: a merge that would not fit in memory runs layer by layer "
        "(--offload auto); one that cannot keep under it at all is refused before any work; a streamed merge "
        "writes smaller shards to fit.",
    )
    @click.option(
        "--offload",
        type=click.Choice(["auto", "always", "never"]),
        default="auto",
        show_default=True,
        help="Run the merge layer by layer with the models' weights in disk-backed working files: when an "
        "in-memory merge would not fit in --max-memory (or in the memory available), always, or never. "
        "Same bytes either way.",
    )
    @click.option(
        "--offload-dir",
        type=click.Path(file_okay=False),
        help="Where the working files of an offloaded merge go (default: the system's temporary directory).",
    )
    @friendly_errors
    def merge_command(out, overwrite, max_shard_size, stream, max_memory, offload, offload_dir, **options):
        """Align B (and any further models) to A, merge, and write a repository that from_pretrained loads.

        MODELS: two or more checkpoints (Hub ids or directories), the first the reference;
        or none, with --config naming a merge file that lists them."""
        from raot_hf.outputs import check_destination, parse_size

        check_destination(out, overwrite)  # refuse before any heavy work
        parse_size(max_shard_size)
        command = "raot-hf " + " ".join(sys.argv[1:]) if sys.argv else None
        resolved = _config_and_models(options)
        streamed = _streamed(options, resolved, out, overwrite, max_shard_size, stream, max_memory, command)
        if streamed is not None:
            if not _quiet():
                click.echo(streamed[1]["summary"])
                click.echo(f"wrote {streamed[0]}")
            return
        memory = {"offload": offload, "offload_dir": offload_dir, "max_memory": max_memory}
        merger = _merger(options, resolved, memory)
        if _followed_main(merger):
            return
        try:
            result = merger.merge()
        finally:
            merger.dist.close()
        result.report["command"] = command
        if not _quiet():
            click.echo(result.alignment.table() if result.alignment.decisions else "(no alignment)")
            click.echo(result.report["summary"])
        path = result.save_pretrained(out, overwrite=overwrite, max_shard_size=max_shard_size)
        if not _quiet():
            click.echo(f"wrote {path}")

    return merge_command


def _streamed(options: dict, resolved: tuple, out, overwrite: bool, max_shard_size, stream: bool, max_memory, command):
    """The merge streamed from the files when it reads no data (:mod:`raot_hf.stages.stream`):
    (path, report), or None when the in-memory path runs. ``--max-memory`` is checked here, before
    any weights are read, for both paths."""
    from raot_hf.distributed import DistributedContext
    from raot_hf.stages.load import model_sources
    from raot_hf.stages.members import prepare_config
    from raot_hf.stages.stream import run_streamed

    if DistributedContext.detect().is_distributed:
        return None
    config, models, base = resolved
    config = prepare_config(config, len(models), base is not None)
    access = (options.get("token"), options.get("trust_remote_code", False), options.get("allow_pickle", False))
    revisions = (options.get("revision"), options.get("revision_b"), options.get("base_revision"))
    sources, base_source = model_sources(models, base, *revisions, access)
    done, _ = run_streamed(sources, base_source, config, out, stream=stream, overwrite=overwrite,
                           max_shard_size=max_shard_size, max_memory=max_memory, command=command)  # fmt: skip
    return done


def _followed_main(merger) -> bool:
    """Under ``accelerate launch``, a process other than the main one adds its shard's statistics
    and stops here (the main process solves, reports and writes); True when that happened."""
    if merger.dist.is_main:
        return False
    from raot_hf.distributed import follow_main

    follow_main(merger)
    merger.dist.close()
    return True


def _inspect_command() -> click.Command:
    """``raot-hf inspect``, built from the live registries."""

    @click.command("inspect")
    @merge_options
    @click.option("--json", "as_json", is_flag=True, help="Print the decisions as JSON.")
    @friendly_errors
    def inspect_command(as_json, **options):
        """Gate decisions and alignment scores without writing a model: do A and B share a basis?"""
        merger = _merger({**options, "_two_only": True})
        if _followed_main(merger):
            return
        try:
            alignment, _, fingerprint = merger.align()
        finally:
            merger.dist.close()
        if as_json:  # strict JSON on stdout (NaN → null), nothing else: logs and progress go to stderr
            record = {
                "shares_basis": alignment.shares_basis,
                "verdict": alignment.verdict,
                "model_fidelity": alignment.model_fidelity,
                "decisions": [d.to_dict() for d in alignment.decisions],
                "calibration": fingerprint,
            }
            click.echo(json.dumps(_finite_json(record), indent=2))
            return
        click.echo(alignment.table())
        if alignment.verdict:
            click.echo(alignment.verdict)

    return inspect_command


_LIVE_COMMANDS = {"merge": _merge_command, "inspect": _inspect_command}


def _finite_json(value):
    """``value`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value


@main.command("selfcheck")
@click.option(
    "--model-type",
    default="all",
    help="A model type with a tiny test architecture (raot_hf.testing.architectures(): bert, llama, gemma2, ...) or all.",
)
@click.option("--debug", is_flag=True)
@friendly_errors
def selfcheck_command(model_type, debug):
    """Check on tiny random models that every symmetry is exact and that a scrambled copy merges back."""
    from raot_hf.testing import architectures

    types = architectures()
    ok = True
    for mt in types if model_type == "all" else [model_type]:
        dev, limit, rec = _selfcheck_one(mt)
        passed = dev <= limit and rec <= 1e-4
        ok &= passed
        click.echo(
            f"{mt:11s} symmetry deviation {dev:.1e} (float64)   merge(A, scramble(A)) vs A {rec:.1e}   "
            f"{'ok' if passed else 'FAIL'}"
        )
    if not ok:
        raise RaotError("self-check failed; please report it with the output above")


def _selfcheck_one(mt: str) -> tuple[float, float, float]:
    """One architecture's float64 symmetry deviation, its limit, and the recovery error."""
    import contextlib

    import torch

    from raot_hf import scramble
    from raot_hf.adapters import is_decoder, modality_of, schema_for
    from raot_hf.merger import RaotMerger
    from raot_hf.symmetry import random_group_element, transform_model
    from raot_hf.testing import clone, exact_rmsnorm, example_inputs, output_deviation, tiny_data, tiny_model

    decoder = is_decoder(mt)
    head = "image" if modality_of(mt) == "image" else "causal" if decoder else "sequence"
    model = tiny_model(mt, head)
    schema = schema_for(model)
    t = random_group_element(schema, seed=0, kinds=("mlp", "heads", "residual", "rescale"))
    # the Llama family's RMSNorm casts to float32 in transformers: checked without the cast
    with exact_rmsnorm() if decoder else contextlib.nullcontext():
        dev = output_deviation(model, transform_model(clone(model), schema, t), example_inputs(model))
    a = tiny_model(mt, head, dtype=torch.float32)
    b = clone(a)
    scramble(b, seed=1)
    pre, data = tiny_data(mt, 192, vocab_size=100) if decoder else tiny_data(mt, 96)
    ref = clone(a)
    result = RaotMerger.from_models(a, b, preprocessor=pre).merge(calibration=data)
    rec = output_deviation(ref, result.model, example_inputs(ref), relative=True)
    # transformers' DeBERTa v1 LayerNorm computes in float32 even for float64 models.
    return dev, 1e-6 if mt == "deberta" else 1e-9, rec


main.add_command(push)
main.add_command(demo)
