"""Property tests of the options layer: any options dict either builds a RaotConfig that
round-trips through JSON exactly, or raises a one-line RaotError — never another exception;
any ``raot-hf merge`` argument list ends in exit code 0 or 2, never a traceback."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from raot_hf import config as config_module
from raot_hf.calibration import CalibrationConfig
from raot_hf.cli import main
from raot_hf.config import RaotConfig
from raot_hf.config.options import LEGACY_KEYS, SECTIONS
from raot_hf.errors import RaotError
from raot_hf.gate import GATE_OBJECTIVES

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Known choices per string option, so that valid values are drawn often enough to pass.
CHOICES = {
    "alignment": config_module.alignments(),
    "residual": config_module.RESIDUAL_MODES,
    "head": config_module.HEAD_POLICIES,
    "merge_rule": config_module.core.merge_rules(),
    "dtype": config_module.DTYPES,
    "objective": GATE_OBJECTIVES,
}

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(-3, 3) | st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _plausible(name: str, default):
    """Values of the option's own type, mostly in (and sometimes just outside) its valid range."""
    if name in CHOICES:
        return st.sampled_from(CHOICES[name]) | st.text(max_size=10)
    if name == "scope":
        entries = st.sampled_from((*config_module.SCOPES, "attention", ""))
        return st.lists(entries, max_size=4) | st.sampled_from(("mlp,heads", "none", "residual+mlp", "mlp,mlp"))
    if isinstance(default, bool):
        return st.booleans() | st.sampled_from(("true", "no", 0, 1))
    if isinstance(default, int):
        return st.integers(-5, 10**6) | st.integers(0, 512).map(float) | st.integers(0, 9).map(str)
    if isinstance(default, float):
        return st.floats(-1.0, 4.0) | st.integers(-1, 3) | st.sampled_from(("0.5", math.inf, -math.inf, math.nan))
    if isinstance(default, str):
        return st.text(max_size=10)
    return JUNK


def _section_dicts(cls):
    """Dicts of a section's settings (CalibrationConfig, GateOptions, …), sometimes with junk keys."""
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    values = {}
    for name, default in fields.items():
        if default is None or isinstance(default, str) and name not in CHOICES:
            values[name] = st.none() | st.text(max_size=10) | JUNK
        else:
            values[name] = _plausible(name, default) | JUNK
    return st.fixed_dictionaries({}, optional=values) | st.dictionaries(st.text(max_size=6), JUNK, max_size=2)


def _field_default(cls, name):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _config_dicts():
    values = {}
    for name, section in SECTIONS.items():
        values[name] = _section_dicts(section) | JUNK
    for f in dataclasses.fields(RaotConfig):
        if f.name == "sections":
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        values[f.name] = _plausible(f.name, default) | JUNK
    for key, (section, name) in LEGACY_KEYS.items():  # the flat keys of earlier versions
        legacy = _plausible(name, _field_default(SECTIONS[section], name)) | JUNK
        values[key] = values[key] | legacy if key in values else legacy
    known = st.fixed_dictionaries({}, optional=values)
    with_unknown = st.tuples(known, st.dictionaries(st.text(min_size=1, max_size=8), JUNK, max_size=2)).map(
        lambda pair: {**pair[1], **pair[0]}
    )
    return known | with_unknown


def _assert_sane(cfg) -> None:
    """An accepted config holds values of each option's own type (no "false" strings for
    booleans, no strings for numbers) and only finite numbers, in every section too."""
    for f in dataclasses.fields(cfg):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(default):
            assert type(value) is type(default), (f.name, value)
            if f.name != "calibration":
                _assert_sane(value)
            continue
        if isinstance(default, bool):
            assert isinstance(value, bool), (f.name, value)
        elif isinstance(default, int):
            assert isinstance(value, int) and not isinstance(value, bool), (f.name, value)
        elif isinstance(default, float):
            assert isinstance(value, float) and math.isfinite(value), (f.name, value)
        elif isinstance(default, str):
            assert isinstance(value, str), (f.name, value)
    if isinstance(cfg, RaotConfig):
        assert isinstance(cfg.scope, tuple) and all(s in config_module.SCOPES for s in cfg.scope)
        assert isinstance(cfg.calibration, CalibrationConfig)


@FUZZ
@given(data=_config_dicts())
def test_any_options_dict_round_trips_or_raises_raot_error(data):
    try:
        cfg = RaotConfig.from_dict(data)
    except RaotError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    _assert_sane(cfg)
    text = cfg.to_json()
    again = RaotConfig.from_json(text)
    assert again == cfg
    assert again.to_json() == text
    assert json.loads(text)["calibration"] == cfg.calibration.to_dict()


@FUZZ
@given(text=st.text(max_size=40) | st.builds(json.dumps, JUNK) | st.builds(json.dumps, _config_dicts()))
def test_any_json_text_builds_a_config_or_raises_raot_error(text):
    try:
        cfg = RaotConfig.from_json(text)
    except RaotError:
        return
    assert RaotConfig.from_json(cfg.to_json()) == cfg


# ------------------------------------------------------------------------------------- CLI

SENTINEL = "sentinel: options parsed, no model loaded"

VALUE_OPTIONS = {
    "--alignment": st.sampled_from(config_module.alignments()) | st.text(max_size=6),
    "--scope": st.sampled_from(("mlp", "heads,residual", "none", "mlp,mlp", "attention", "")),
    "--residual": st.sampled_from(config_module.RESIDUAL_MODES) | st.text(max_size=6),
    "--merge-rule": st.sampled_from(config_module.core.merge_rules()) | st.just("ties"),
    "--head": st.sampled_from(config_module.HEAD_POLICIES) | st.just("c"),
    "--dtype": st.sampled_from(config_module.DTYPES) | st.just("int8"),
    "--alpha": st.floats(-1, 2).map(repr) | st.sampled_from(("nan", "inf", "x", "1e309", "")),
    "--gate-z": st.floats(-2, 10).map(repr) | st.sampled_from(("nan", "inf", "-inf")),
    "--gate-min-gain": st.floats(-1, 3).map(repr) | st.just("nan"),
    "--regmean-shrink": st.floats(-1, 2).map(repr),
    "--soft-ot-reg": st.floats(-1, 1).map(repr) | st.just("0"),
    "--min-heldout-tokens": st.integers(-10, 10**5).map(str) | st.just("1.5"),
    "--fisher-samples": st.integers(-3, 300).map(str),
    "--seed": st.integers(-3, 2**40).map(str) | st.just("seven"),
    "--num-samples": st.integers(-3, 5000).map(str),
    "--max-length": st.integers(-3, 600).map(str),
    "--batch-size": st.integers(-3, 64).map(str) | st.just("0x10"),
    "--moment-stride": st.integers(-2, 9).map(str),
    "--gate-examples": st.integers(-2, 40).map(str),
    "--density": st.floats(-0.5, 1.5).map(repr),
    "--check-batches": st.integers(-2, 4).map(str),
    "--calibration-seed": st.integers(-2, 9).map(str),
    "--heldout-every": st.integers(-1, 9).map(str),
    "--calibration": st.sampled_from(("data.csv", "org/dataset", "")) | st.text(max_size=8),
    "--calibration-config": st.text(max_size=6),
    "--split": st.sampled_from(("train", "validation[:10]", "")),
    "--column": st.sampled_from(("text", "image", "")),
    "--revision": st.sampled_from(("main", "v1.0", "")),
    "--revision-b": st.sampled_from(("main", "")),
    "--token": st.sampled_from(("hf_xxx", "")),
    "--max-shard-size": st.sampled_from(("2GB", "100MB", "1000")),
    "--config": st.sampled_from(("valid.json", "bad.json", "list.json", "binary.json", "dir", "missing.json")),
}
FLAGS = (
    "--gate",
    "--no-gate",
    "--rotations",
    "--no-rotations",
    "--weight-rescale",
    "--no-weight-rescale",
    "--no-weight-match-heads",
    "--no-sibling-check",
    "--trust-remote-code",
    "--allow-pickle",
    "--overwrite",
    "--bogus-flag",
)
OPTION_TO_FIELD = {
    "--alignment": "alignment",
    "--residual": "residual",
    "--merge-rule": "merge_rule",
    "--head": "head",
    "--dtype": "dtype",
    "--alpha": "alpha",
    "--gate-z": "gate.z",
    "--gate-min-gain": "gate.min_gain",
    "--regmean-shrink": "regmean.shrink",
    "--soft-ot-reg": "soft_ot.reg",
    "--min-heldout-tokens": "gate.min_heldout_tokens",
    "--fisher-samples": "fisher.samples",
    "--gate-examples": "gate.examples",
    "--density": "task_vectors.density",
    "--check-batches": "check_batches",
    "--calibration-seed": "calibration.seed",
    "--heldout-every": "calibration.heldout_every",
    "--seed": "seed",
}


@st.composite
def _merge_arguments(draw):
    chosen = draw(st.lists(st.sampled_from(sorted(VALUE_OPTIONS)), unique=True, max_size=6))
    args, given_values = [], {}
    for option in chosen:
        value = draw(VALUE_OPTIONS[option])
        args += [option, value]
        given_values[option] = value
    args += draw(st.lists(st.sampled_from(FLAGS), unique=True, max_size=2))
    # Mostly well-formed positionals and --out, so that many cases reach the options layer.
    positional = draw(st.sampled_from((["a", "b"],) * 6 + (["a"], [], ["a", "b", "c"])))
    out = draw(st.sampled_from((["--out", "out"],) * 6 + (["--out", "existing"], ["--out", "afile/sub"], [])))
    order = draw(st.permutations(range(3)))
    parts = [args, positional, out]
    return ["merge"] + [x for i in order for x in parts[i]], given_values


@pytest.fixture
def cli_sandbox(tmp_path, monkeypatch):
    """A working directory with the files the fuzzed --config values name, and a
    from_pretrained that stops right after the options were parsed into a RaotConfig."""
    (tmp_path / "valid.json").write_text(RaotConfig(alpha=0.25).to_json())
    (tmp_path / "bad.json").write_text("{alpha: 0.25")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage\x80")
    (tmp_path / "dir").mkdir()
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "keep.txt").write_text("x")
    (tmp_path / "afile").write_text("a regular file")
    monkeypatch.chdir(tmp_path)
    seen = []

    def stop_after_parsing(cls, *models, config=None, **kwargs):
        assert isinstance(config, RaotConfig)
        seen.append(config)
        raise RaotError(SENTINEL)

    from raot_hf.merger import RaotMerger

    monkeypatch.setattr(RaotMerger, "from_pretrained", classmethod(stop_after_parsing))
    return tmp_path, seen


def _case(*args: str):
    values = {a: b for a, b in zip(args, args[1:]) if a in VALUE_OPTIONS}
    return ["merge", "a", "b", "--out", "out", *args], values


@FUZZ
@given(case=_merge_arguments())
@example(case=_case("--config", "binary.json"))
@example(case=_case("--config", "list.json"))
@example(case=_case("--config", "valid.json", "--seed", "3"))
@example(case=_case("--gate-z", "inf"))
@example(case=_case("--alpha", "nan"))
@example(case=_case("--num-samples", "0"))
@example(case=_case("--scope", "mlp,mlp"))
def test_any_merge_arguments_exit_2_with_one_error_line(cli_sandbox, case):
    root, seen = cli_sandbox
    args, given_values = case
    before = sorted(p.name for p in root.iterdir())
    seen.clear()
    res = CliRunner().invoke(main, args)
    # the patched from_pretrained always raises: every case ends in exit 2 (bad option or the sentinel)
    assert res.exit_code == 2, (args, res.exit_code, repr(res.exception), res.output)
    assert "Traceback" not in res.output
    assert isinstance(res.exception, SystemExit) or res.exception is None
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, (args, res.stderr)
    assert sorted(p.name for p in root.iterdir()) == before  # nothing written, nothing created
    event("options reached the merger" if seen else "rejected before the merger")
    if seen:  # the options reached the merger: each flag value landed in its field
        assert SENTINEL in res.stderr
        cfg = seen[0]
        for option, field_name in OPTION_TO_FIELD.items():
            if option in given_values:
                value, given_value = cfg.lookup(field_name), given_values[option]
                expected = given_value if isinstance(value, str) else type(value)(float(given_value))
                assert value == expected, (option, given_value, value)
        if given_values.get("--config") == "valid.json" and "--alpha" not in given_values:
            assert cfg.alpha == 0.25  # the file's value, where no flag overrides it
