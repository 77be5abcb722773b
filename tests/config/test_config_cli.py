"""The CLI is generated from RaotConfig: every field (into its sections) has exactly one flag on
``merge`` and ``inspect``, each flag lands in its field, the flags of earlier versions keep their
names, the flat keys of earlier versions are still read, nested JSON round-trips, and the
README's command lines still parse."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

import click
import pytest
import torch

from raot_hf.cli import build_config, main
from raot_hf.config import RaotConfig
from raot_hf.errors import RaotError
from raot_hf.gate import GateOptions
from raot_hf.merger import RaotMerger
from raot_hf.testing import tiny_model, tiny_tokenizer

COMMANDS = ("merge", "inspect")
#: Options of merge / inspect that are not RaotConfig fields (hand-written in raot_hf.cli).
NOT_CONFIG = {
    "models",
    "config_file",
    "revision",
    "revision_b",
    "token",
    "trust_remote_code",
    "allow_pickle",
    "debug",
    "out",
    "base",
    "base_revision",
    "overwrite",
    "max_shard_size",
    "stream",
    "max_memory",
    "offload",
    "offload_dir",
    "as_json",
    "help",
}
#: Every config flag the CLI had before it was generated: names and meanings must not change.
FLAGS_BEFORE = {
    "--gate": "gate.enabled",
    "--no-gate": "gate.enabled",
    "--gate-z": "gate.z",
    "--gate-min-gain": "gate.min_gain",
    "--min-heldout-tokens": "gate.min_heldout_tokens",
    "--gate-objective": "gate.objective",
    "--gate-examples": "gate.examples",
    "--sibling-check": "gate.sibling_check",
    "--no-sibling-check": "gate.sibling_check",
    "--weight-rescale": "weight.rescale",
    "--no-weight-rescale": "weight.rescale",
    "--soft-ot-reg": "soft_ot.reg",
    "--regmean-shrink": "regmean.shrink",
    "--fisher-samples": "fisher.samples",
    "--density": "task_vectors.density",
    "--task-scale": "task_vectors.scale",
    "--calibration": "calibration.source",
    "--calibration-config": "calibration.config_name",
    "--split": "calibration.split",
    "--column": "calibration.column",
    "--num-samples": "calibration.num_samples",
    "--max-length": "calibration.max_length",
    "--batch-size": "calibration.batch_size",
    "--moment-stride": "calibration.moment_stride",
    "--alignment": "alignment",
    "--scope": "scope",
    "--residual": "residual",
    "--rotations": "rotations",
    "--no-rotations": "rotations",
    "--merge-rule": "merge_rule",
    "--alpha": "alpha",
    "--head": "head",
    "--dtype": "dtype",
    "--seed": "seed",
}
#: Fields that had no flag before, and the flags they have now.
FLAGS_ADDED = {
    "--weight-match-heads": "weight.match_heads",
    "--no-weight-match-heads": "weight.match_heads",
    "--check-batches": "check_batches",
    "--calibration-seed": "calibration.seed",
    "--heldout-every": "calibration.heldout_every",
    "--weights": "models.weights",
    "--densities": "models.densities",
    "--reference": "models.reference",
}
#: The flat keys of earlier versions, a non-default value each, and where the value lands.
LEGACY = {
    "gate": (False, "gate.enabled"),
    "gate_z": (2.0, "gate.z"),
    "gate_min_gain": (0.02, "gate.min_gain"),
    "min_heldout_tokens": (16, "gate.min_heldout_tokens"),
    "gate_objective": ("alignment", "gate.objective"),
    "gate_examples": (8, "gate.examples"),
    "sibling_check": (False, "gate.sibling_check"),
    "weight_rescale": (True, "weight.rescale"),
    "weight_match_heads": (False, "weight.match_heads"),
    "soft_ot_reg": (0.3, "soft_ot.reg"),
    "regmean_shrink": (0.5, "regmean.shrink"),
    "fisher_samples": (32, "fisher.samples"),
    "density": (0.3, "task_vectors.density"),
    "task_scale": (2.0, "task_vectors.scale"),
}
# One value per click type that every field of that type accepts and that no default equals.
VALUE_FOR_TYPE = {click.INT: "5", click.FLOAT: "0.125", click.STRING: "mlp"}
#: Values of the string options that are number lists, and what they parse to.
VALUE_FOR_FLAG = {
    "--weights": ("0.5,0.25", (0.5, 0.25)),
    "--densities": ("0.5,0.25", (0.5, 0.25)),
    "--t": ("self_attn=0,1;default=0.5", {"self_attn": [0.0, 1.0], "default": 0.5}),
    "--density": ("0,0.5,1", [0.0, 0.5, 1.0]),
    "--epsilon": ("0.1", 0.1),
    "--gamma": ("0.02", 0.02),
    "--task-scale": ("1.5", 1.5),
    "--refit-steps": ("50", 50),  # auto, or a number
    "--correction-batch-size": ("16", 16),  # auto, or a number
}


def _field_paths(cls, prefix=()):
    """Every RaotConfig field, recursively into its sections, as a dotted path (no ``version``:
    the stamp of the writing version, not an option)."""
    if not prefix:  # the sections registered beside their methods
        for name, section in cls.section_classes().items():
            yield from _field_paths(section, (name,))
    for f in dataclasses.fields(cls):
        if f.name in ("version", "sections") and not prefix:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            yield from _field_paths(type(default), (*prefix, f.name))
        else:
            yield ".".join((*prefix, f.name))


def _flat(cfg: RaotConfig) -> dict:
    return {path: cfg.lookup(path) for path in _field_paths(RaotConfig)}


def _params(command: str, args: list[str]) -> dict:
    """The parsed parameters of ``raot-hf <command> a b <args>`` (nothing runs)."""
    extra = ["--out", "o"] if command == "merge" else []
    return main.get_command(None, command).make_context(command, ["a", "b", *extra, *args]).params


def _parse(command: str, args: list[str]) -> RaotConfig:
    """The RaotConfig ``raot-hf <command> a b <args>`` builds (nothing runs)."""
    return build_config(_params(command, args))


def _config_params(command: str) -> list[click.Option]:
    return [p for p in main.get_command(None, command).params if p.name not in NOT_CONFIG]


def _invocations(param: click.Option) -> list[list[str]]:
    """Argument lists that give ``param`` a valid value other than its field's default."""
    if param.is_flag:
        return [[opt] for opt in (*param.opts, *param.secondary_opts)]
    if isinstance(param.type, click.Choice):
        return [[param.opts[0], choice] for choice in param.type.choices]
    if param.opts[0] in VALUE_FOR_FLAG:
        return [[param.opts[0], VALUE_FOR_FLAG[param.opts[0]][0]]]
    return [[param.opts[0], VALUE_FOR_TYPE[param.type]]]


def _changed(command: str, args: list[str]) -> dict:
    default, parsed = _flat(RaotConfig()), _flat(_parse(command, args))
    return {path: value for path, value in parsed.items() if value != default[path]}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_config_field_has_exactly_one_flag(command):
    """Each config option changes exactly one field, and each field is changed by exactly one option."""
    owners: dict[str, list[str]] = {path: [] for path in _field_paths(RaotConfig)}
    for param in _config_params(command):
        touched = set()
        for args in _invocations(param):
            touched |= set(_changed(command, args))
        assert len(touched) == 1, (param.opts, touched)
        owners[touched.pop()].append(param.opts[0])
    assert {path: opts for path, opts in owners.items() if len(opts) != 1} == {}


@pytest.mark.parametrize("command", COMMANDS)
def test_each_flag_value_lands_in_its_field(command):
    for param in _config_params(command):
        for args in _invocations(param):
            changed = _changed(command, args)
            if not changed:  # a choice or a boolean equal to the field's default
                continue
            ((path, value),) = changed.items()
            if param.is_flag:
                expected = args[0] in param.opts  # --x sets True, --no-x False
            elif param.type in (click.INT, click.FLOAT):
                expected = param.type.convert(args[1], param, None)
            elif args[0] in VALUE_FOR_FLAG:
                expected = VALUE_FOR_FLAG[args[0]][1]
            else:
                expected = ("mlp",) if path == "scope" else args[1]
            assert value == expected and type(value) is type(expected), (args, path, value)


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_keep_their_names_and_meanings(command):
    opts = {opt: p for p in main.get_command(None, command).params for opt in (*p.opts, *p.secondary_opts)}
    for flag, path in {**FLAGS_BEFORE, **FLAGS_ADDED}.items():
        assert flag in opts, flag
        param = opts[flag]
        if param.is_flag:
            assert param.default is None, flag  # only an explicit flag overrides --config
            changed = {**_changed(command, param.opts[:1]), **_changed(command, param.secondary_opts[:1])}
            assert (flag in param.opts) != (flag in param.secondary_opts) and param.secondary_opts, flag
        else:
            changed = {path: v for args in _invocations(param) for path, v in _changed(command, args).items()}
        assert set(changed) == {path}, (flag, changed)
    merge_rules = next(p for p in _config_params(command) if p.name == "merge_rule").type.choices
    from raot_hf.merging import available_merge_rules

    assert sorted(merge_rules) == available_merge_rules()


def test_flags_override_the_config_file_and_nothing_else(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(RaotConfig.from_dict({"gate_z": 2.0, "density": 0.4, "alpha": 0.25}).to_json())
    cfg = _parse("merge", ["--config", str(path), "--density", "0.3", "--no-gate"])
    assert (cfg.gate.z, cfg.task_vectors.density, cfg.alpha, cfg.gate.enabled) == (2.0, 0.3, 0.25, False)
    path.write_text(json.dumps({"gate": False, "regmean_shrink": 0.5}))  # an old flat file
    cfg = _parse("inspect", ["--config", str(path), "--gate"])
    assert (cfg.gate.enabled, cfg.regmean.shrink) == (True, 0.5)


def test_legacy_flat_keys_are_read_everywhere():
    flat = {key: value for key, (value, _) in LEGACY.items()}
    for cfg in (
        RaotConfig.from_dict(flat),
        RaotConfig.from_json(json.dumps(flat)),
        RaotConfig().replace(**flat),
    ):
        for key, (value, path) in LEGACY.items():
            assert cfg.lookup(path) == value, key
    # a flat key changes one field; the rest of its section is kept
    cfg = RaotConfig(gate={"z": 2.0}).replace(gate=False, regmean_shrink=0.5)
    assert (cfg.gate.enabled, cfg.gate.z, cfg.regmean.shrink) == (False, 2.0, 0.5)
    assert RaotConfig(gate=False).gate == GateOptions(enabled=False)
    assert RaotConfig(gate=False).replace(gate=True).gate.enabled is True
    with pytest.raises(RaotError, match="gate='false' must be true or false"):
        RaotConfig(gate="false")
    with pytest.raises(RaotError, match=r"gate_z=-1\.0 must be ≥ 0"):
        RaotConfig.from_dict({"gate_z": -1})


def test_the_earlier_section_name_group_reads_as_models(tmp_path):
    """A config or merge file written when the several-model options were called ``group`` still
    reads; ``to_dict`` writes ``models``."""
    from raot_hf.merging.mergefile import read_merge_file

    old = {"group": {"weights": [0.5, 0.25, 0.25], "reference": "central"}, "alpha": 0.25}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    for cfg in (
        RaotConfig.from_dict(old),
        RaotConfig.from_json(json.dumps(old)),
        _parse("merge", ["--config", str(path)]),
    ):
        assert (cfg.models.weights, cfg.models.reference, cfg.alpha) == ((0.5, 0.25, 0.25), "central", 0.25)
        assert "models" in cfg.to_dict() and "group" not in cfg.to_dict()
    changed = RaotConfig(models={"weights": [1, 1, 2]}).replace(group={"reference": "central"})
    assert changed.models == RaotConfig(models={"reference": "central"}).models
    with pytest.raises(RaotError, match="both 'group'.*and 'models'"):
        RaotConfig.from_dict({"group": {}, "models": {}})
    merge_file = {
        "models": [{"model": "a"}, {"model": "b"}, {"model": "c"}],
        "merge_method": "linear",
        "raot": {"group": {"reference": "central"}},
    }
    assert read_merge_file(merge_file).config.models.reference == "central"


def test_unknown_keys_are_one_line_errors_listing_the_valid_names():
    with pytest.raises(RaotError) as info:
        RaotConfig.from_dict({"gate_zz": 1})
    message = str(info.value)
    assert "\n" not in message and "'gate_zz'" in message and "gate_z" in message and "task_vectors" in message
    with pytest.raises(RaotError, match="unknown gate option.*'zz'.*valid: .*min_gain"):
        RaotConfig.from_dict({"gate": {"zz": 1}})
    with pytest.raises(RaotError, match="weight=5 must be a WeightMatchingOptions"):
        RaotConfig(weight=5)


def test_nested_json_round_trips():
    cfg = RaotConfig(
        gate={"z": 2.5, "objective": "alignment", "examples": 8},
        weight={"rescale": True},
        base_rules={"density": 0.3, "task_scale": 2},
        regmean={"shrink": 0.5},
        calibration={"num_samples": 64, "seed": 3},
        scope="mlp,heads",
        check_batches=2,
    )
    text = cfg.to_json()
    data = json.loads(text)
    assert data["gate"]["z"] == 2.5
    assert data["task_vectors"] == {"density": 0.3, "scale": 2.0, "epsilon": None, "gamma": None}
    assert data["version"] and not {"gate_z", "density", "regmean_shrink"} & set(data)
    again = RaotConfig.from_json(text)
    assert again == cfg and again.to_json() == text
    assert RaotConfig.from_dict(cfg.to_dict()) == cfg


def test_merger_reads_legacy_keyword_options(tmp_path):
    for name in ("a", "b"):
        tiny_model("bert", "sequence", dtype=torch.float32).save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    kwargs = {key: value for key, (value, _) in LEGACY.items()}
    merger = RaotMerger.from_pretrained(tmp_path / "a", tmp_path / "b", alignment="none", **kwargs)
    models = (tiny_model("bert", "sequence"), tiny_model("bert", "sequence", seed=1))
    wrapped = RaotMerger.from_models(*models, alignment="none", **kwargs)
    for config in (merger.config, wrapped.config):
        for key, (value, path) in LEGACY.items():
            assert config.lookup(path) == value, key


def _readme_commands() -> list[list[str]]:
    """The ``raot-hf merge`` / ``raot-hf inspect`` command lines of README.md, split into words."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    lines = re.findall(r"^raot-hf (?:merge|inspect) .*$", readme.read_text(encoding="utf-8"), flags=re.M)
    return [shlex.split(line.split("#", 1)[0])[1:] for line in lines]


def test_readme_command_lines_still_parse():
    commands = _readme_commands()
    assert len(commands) >= 3
    for words in commands:
        command = main.get_command(None, words[0])
        known = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
        help_text = command.get_help(click.Context(command, info_name=words[0]))
        for flag in (w for w in words if w.startswith("--")):
            assert flag in known and flag in help_text, (words, flag)
        params = command.make_context(words[0], words[1:]).params
        if params.get("config_file") not in (
            "merge.yml",
            "dare_ties.yml",
        ):  # merge files: test_members, test_mergekit_corpus
            build_config(params)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_a_python_keyword_of_the_same_name(command):
    """``--moment-precision float32`` is ``moment_precision="float32"``, ``--correction none`` is
    ``correction="none"``, ``--no-gate`` is ``gate=False``: every config option of the command line
    sets the same field to the same value as a keyword of RaotConfig (and so of
    ``RaotMerger.from_pretrained``); every other option is a keyword of ``from_pretrained`` or of
    ``save_pretrained`` (``--out`` is its ``out_dir``), or is the command line's own."""
    import inspect as pyinspect

    from raot_hf.config.options import flag_keyword
    from raot_hf.results import MergeResult

    for param in _config_params(command):
        for args in _invocations(param):
            want = _parse(command, args)
            value = _params(command, args)[param.name]
            keyword = flag_keyword(param.opts[0])
            got = RaotConfig().replace(**{keyword: value})
            assert got.to_dict() == want.to_dict(), (args, keyword, value)
    python = set(pyinspect.signature(RaotMerger.from_pretrained).parameters)
    python |= set(pyinspect.signature(MergeResult.save_pretrained).parameters) | {"out"}
    cli_only = {"models", "config_file", "debug", "as_json", "stream", "overwrite"}
    others = {p.name for p in main.get_command(None, command).params} & NOT_CONFIG
    assert others - cli_only <= python, others - cli_only - python


def test_an_unknown_keyword_names_the_closest_valid_one():
    with pytest.raises(RaotError, match="'moment_precison' \\(did you mean 'moment_precision'\\?\\)"):
        RaotConfig().replace(moment_precison="float32")
    with pytest.raises(RaotError, match="did you mean 'correction'"):
        RaotConfig.from_dict({"corection": "none"})
    # nested sections keep working, and a section name with a plain value sets its flag's field
    cfg = RaotConfig().replace(correction="none", calibration={"moment_precision": "float32"}, gate=False)
    assert (cfg.correction.method, cfg.calibration.moment_precision, cfg.gate.enabled) == ("none", "float32", False)


def test_settings_of_earlier_sections_are_read_where_they_live_now():
    """A config or report written when the task-vector rules' settings lived in ``base_rules`` and
    ``mergekit`` reads into ``task_vectors``; the earlier flags still set them."""
    from raot_hf.merging import TaskVectorOptions

    earlier = {
        "merge_rule": "della",
        "base_rules": {"density": 0.3, "task_scale": 2.0},
        "mergekit": {"epsilon": 0.1, "t": 0.5},
    }
    config = RaotConfig.from_dict(earlier)
    assert config.task_vectors == TaskVectorOptions(density=0.3, scale=2.0, epsilon=0.1)
    assert config.mergekit.t == 0.5 and RaotConfig.from_json(config.to_json()) == config
    command = main.get_command(None, "merge")
    for flag in ("--mergekit-density", "--density"):
        params = command.make_context("merge", ["A", "B", "--out", "m", flag, "0.4"]).params
        assert build_config(params).task_vectors.density == 0.4
