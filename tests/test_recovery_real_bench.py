"""Smoke test of benchmarks/perf/recovery_real.py's records and report (no model is loaded):
the markdown is generated from the JSON records alone, and appending keeps earlier records."""

import json

import pytest

bench = pytest.importorskip("benchmarks.perf.recovery_real")


def _record(model: str, precision: str, rel_fro: float, rel_max: float, *, commit: str = "abc123", **extra) -> dict:
    record = {
        "schema": bench.SCHEMA,
        "date": "2026-01-02T03:04:05+00:00",
        "model": model,
        "package": "pkg==1.0",
        "checkpoint": "org/name",
        "format": "safetensors",
        "architecture": "BertModel",
        "model_type": "bert",
        "params": 22_713_216,
        "causal": False,
        "precision_requested": precision,
        "precision_used": precision,
        "precision_why": "requested",
        "correction": "none",
        "texts": {"source": "fake texts", "calibration": 256, "heldout": 32},
        "output": "last_hidden_state",
        "rel_fro": rel_fro,
        "rel_max": rel_max,
        "recovered": rel_fro <= bench.RECOVERED,
        "generate": None,
        "transforms": {
            "total": 13,
            "applied": 12,
            "rejected": 1,
            "rejected_list": [{"transform": "mlp", "layer": 4, "status": "below_margin", "reason": "r"}],
        },
        "near_ties": {"layers": 6, "near_tied": 7, "changed": 2},
        "merge_s": 41.25,
        "command": "python benchmarks/perf/recovery_real.py --models minilm",
        "git": {"commit": commit, "subject": "s", "dirty": True, "dirty_files": [" M x.py"], "diff_sha256": "feed"},
        "machine": {"cpu": "Fake CPU 9000", "cpu_capability": "AVX512", "bf16_units": "AMX", "torch_threads": 2},
    }
    record.update(extra)
    return record


def test_markdown_comes_from_the_records(tmp_path):
    records = [
        _record("minilm", "float32", 8.77e-07, 6.07e-07),
        _record("minilm", "bfloat16", 3.21e-02, 4.56e-01, commit="def456"),
        _record(
            "smollm2",
            "bfloat16",
            1.5e-01,
            2.5e-01,
            causal=True,
            architecture="LlamaForCausalLM",
            generate={"prompts": 8, "new_tokens": 16, "equal": 5, "first_diff": [1, 2, 3]},
        ),
    ]
    path = tmp_path / "results.json"
    bench.append_records(records[:1], path)
    all_records = bench.append_records(records[1:], path)
    assert json.loads(path.read_text()) == all_records == records  # appended, nothing rewritten

    text = bench.write_report(bench.read_records(path), tmp_path / "results.md")
    assert text == (tmp_path / "results.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 3
    for row, record in zip(rows, records):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert bench.fmt_ratio(record["rel_fro"]) in cells and bench.fmt_ratio(record["rel_max"]) in cells
        assert f"{record['precision_requested']} → {record['precision_used']}" in cells
        assert "12 / 13" in cells and "mlp L4 (below_margin)" in cells and "7 (2)" in cells
    assert float(rows[0].split(" | ")[10]) == pytest.approx(8.77e-07)
    assert "yes" in rows[0] and "**no**" in rows[1] and "5/8" in rows[2]
    # two commits: two runs, each with its command, commit and machine in the text
    assert "**R1**" in text and "**R2**" in text and "R3" not in text
    assert "`abc123`" in text and "`def456`" in text and "Fake CPU 9000" in text and "AMX" in text
    assert "`python benchmarks/perf/recovery_real.py --models minilm`" in text


def test_report_flag_only_regenerates_the_markdown(tmp_path):
    path, out = tmp_path / "r.json", tmp_path / "r.md"
    bench.append_records([_record("minilm", "auto", 1.0e-06, 2.0e-06)], path)
    before = path.read_text()
    bench.main(["--report", "--json", str(path), "--out", str(out)])
    assert path.read_text() == before
    assert "1.00e-06" in out.read_text() and "2.00e-06" in out.read_text()
