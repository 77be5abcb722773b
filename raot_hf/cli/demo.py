"""``raot-hf demo``: the embedded default job.

Two small ViTs trained from different seeds on scikit-learn's digits (shipped offline, built
reproducibly and cached) are merged with RaOT alignment, with the weight-based baseline and
without alignment; the gate table and the accuracies of parents and merges are printed.
"""

from __future__ import annotations

import copy
import time

import click

from raot_hf.cli.errors import friendly_errors


@click.command("demo")
@click.option("--dataset", type=click.Choice(["digits", "mnist5k"]), default="digits", show_default=True)
@click.option("--hidden-size", default=64, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--heads", default=4, show_default=True)
@click.option("--seeds", default="0,1", show_default=True, help="Seeds of A and B.")
@click.option("--out", type=click.Path(file_okay=False), help="Also write the RaOT merge here.")
@click.option("--overwrite", is_flag=True)
@click.option("--cache-dir", type=click.Path(file_okay=False), help="Where trained parents are cached.")
@click.option("--debug", is_flag=True)
@friendly_errors
def demo(dataset, hidden_size, layers, heads, seeds, out, overwrite, cache_dir, debug):
    """Train (or reuse) two ViTs on offline digits and merge them with and without alignment."""
    import transformers

    from raot_hf.demo import build_vit_pair, load_image_dataset

    if out:
        from raot_hf.outputs import check_destination

        check_destination(out, overwrite)
    seed_a, seed_b = _parse_seeds(seeds)
    start = time.perf_counter()
    click.echo(
        f"building parents: ViT d={hidden_size}, {layers} layers, {heads} heads on {dataset} "
        f"(seeds {seed_a}, {seed_b}; cached)"
    )
    path_a, path_b = build_vit_pair(
        dataset,
        seeds=(seed_a, seed_b),
        hidden_size=hidden_size,
        num_layers=layers,
        num_heads=heads,
        cache_dir=cache_dir,
    )
    data = load_image_dataset(dataset)
    processor = transformers.AutoImageProcessor.from_pretrained(path_a)
    calibration = data["calibration"].remove_columns("label")
    test = data["test"]
    rows = _parent_rows(path_a, path_b, test, processor)
    merge_rows, raot_result = _merge_rows(path_a, path_b, calibration, test, processor)
    _print_results(raot_result, rows + merge_rows, len(test), time.perf_counter() - start)
    if out:
        path = copy.copy(raot_result).save_pretrained(out, overwrite=overwrite)
        click.echo(f"wrote the RaOT merge to {path}")


def _parse_seeds(seeds: str) -> tuple[int, int]:
    """The seeds of A and B from ``--seeds`` ("0,1")."""
    try:
        seed_a, seed_b = (int(s) for s in seeds.split(","))
    except ValueError:
        raise click.BadParameter("expected two integers like 0,1", param_hint="--seeds") from None
    return seed_a, seed_b


def _parent_rows(path_a, path_b, test, processor) -> list[tuple[str, float, str]]:
    """The table rows of the two parents: label, test accuracy, transforms applied ("-")."""
    import transformers

    from raot_hf.demo import evaluate_accuracy

    rows = []
    for name, path in (("A", path_a), ("B", path_b)):
        model = transformers.AutoModelForImageClassification.from_pretrained(path)
        rows.append((f"parent {name}", evaluate_accuracy(model, test, processor), "-"))
    return rows


def _merge_rows(path_a, path_b, calibration, test, processor):
    """Merge A and B with each demo method; returns their table rows and the gated RaOT result."""
    from raot_hf.config import RaotConfig
    from raot_hf.demo import evaluate_accuracy
    from raot_hf.merger import RaotMerger

    methods = [
        ("average (no alignment)", dict(alignment="none")),
        ("weight matching (paper, ungated)", dict(alignment="weight", gate=False)),
        ("RaOT (activation + gate)", dict(alignment="activation")),
        ("RaOT, RegMean", dict(alignment="activation", merge_rule="regmean")),
    ]
    rows, raot_result = [], None
    for label, options in methods:
        cfg = RaotConfig.from_dict(options)
        cfg.calibration.num_samples = len(calibration)
        merger = RaotMerger.from_pretrained(path_a, path_b, config=cfg)
        result = merger.merge(calibration=calibration)
        decisions = result.alignment.decisions
        applied = f"{sum(d.applied for d in decisions)}/{len(decisions)}" if decisions else "-"
        rows.append((label, evaluate_accuracy(result.model, test, processor), applied))
        if options == {"alignment": "activation"}:
            raot_result = result
    return rows, raot_result


def _print_results(raot_result, rows, num_test: int, seconds: float) -> None:
    """Print the RaOT gate table, its summary and the accuracy table."""
    click.echo("\nGate (RaOT, held-out statistics):")
    click.echo(raot_result.alignment.table())
    click.echo(f"\n{raot_result.report['summary']}")
    click.echo(f"\n{'model':<34} {'test accuracy':>13} {'transforms applied':>19}")
    for label, acc, applied in rows:
        click.echo(f"{label:<34} {acc:>13.3f} {applied:>19}")
    click.echo(f"\n(chance = 0.100; {num_test} test images; {seconds:.0f} s)")
