"""The house's rules, read from the source: floors, no cycles, small files, a pure cost model.

A module imports only from its own floor or below (imports inside functions count). Floors,
bottom up: 1 pure facts (layout, hashing, presets, wire), 2 sending and pricing (comm, plan,
launch, rss), 3 vocab matrices, sampling and the compiled passes (kernels: level with sampling, whose
float steps they compute), 4 the head and collection, 5 integrations,
6 demo, plots and the planner's report text, 7 the command line."""

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "vocabpar"

FLOORS = {
    "layout": 1, "hashing": 1, "exactmath": 1, "presets": 1, "wire": 1, "host_reads": 1,
    "comm": 2, "plan": 2, "launch": 2, "rss": 2,
    "weights": 3, "embedding": 3, "sampling": 3, "kernels": 3,
    "head": 4, "collect": 4,
    "integrations": 5,
    "demo": 6, "plots": 6, "bench": 6, "report": 6,
    "cli": 7, "__main__": 7,
}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (packages by their ``__init__``)."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _floor(module: str) -> int | None:
    """A module's floor (``None`` for the top-level package, a facade of re-exports)."""
    parts = module.split(".")
    return FLOORS[parts[1]] if len(parts) > 1 else None


def _imports(module: str) -> set[str]:
    """Every module ``module`` imports anywhere in its file (``from vocabpar import comm`` names
    the module ``vocabpar.comm``)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{module}: relative import (the rules read absolute ones)"
            base = node.module
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found |= {name} if name in MODULES else {base, name}
    return found - {module}


IMPORTS = {m: _imports(m) for m in MODULES}
GRAPH = {m: {dep for dep in deps if dep in MODULES} for m, deps in IMPORTS.items()}


def test_every_module_has_a_floor():
    assert all(_floor(m) is not None for m in MODULES if m != "vocabpar"), sorted(
        m for m in MODULES if m != "vocabpar" and m.split(".")[1] not in FLOORS)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "vocabpar"))
def test_imports_go_down_or_level(module):
    upward = {m: _floor(m) for m in GRAPH[module] if m == "vocabpar" or _floor(m) > _floor(module)}
    assert not upward, f"{module} (floor {_floor(module)}) imports from above: {upward}"


def test_no_import_cycle():
    """Depth-first search over the import graph, package facades included."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(GRAPH[m]):
            if dep == "vocabpar":
                continue
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


def test_the_cost_model_and_the_wire_import_no_plotting_and_no_torch_distributed():
    for module, deps in IMPORTS.items():
        if module.startswith(("vocabpar.plan", "vocabpar.wire")):
            banned = {d for d in deps if d.startswith(("matplotlib", "torch.distributed", "vocabpar.comm"))}
            assert not banned, f"{module} imports {banned}"


def test_the_kernels_take_only_the_float_steps_from_sampling_and_never_send():
    """The compiled passes compute the float steps of ``sampling.noise`` and ``sampling.semantics``;
    they import no sampler orchestration and nothing that crosses ranks."""
    allowed = {"vocabpar.sampling.noise", "vocabpar.sampling.semantics"}
    for module, deps in GRAPH.items():
        if module.startswith("vocabpar.kernels"):
            banned = {d for d in deps - allowed if d.startswith(("vocabpar.sampling", "vocabpar.comm"))}
            assert not banned, f"{module} imports {banned}"


def test_no_source_file_over_the_limit():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines()))
            > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_integrations_do_not_import_each_other_both_ways():
    hf, spec = "vocabpar.integrations.hf", "vocabpar.integrations.speculative"
    assert hf not in GRAPH[spec], "the speculative loop must not import the Hugging Face drop-in"


def test_a_filter_stated_as_data_is_named_only_where_its_kind_needs():
    """A mask filter (one whose floor comes from exact sums that ride in round one) is its entry in
    ``wire/filters.py``, its parameter in ``sampling/params.py``, its module and its line in
    ``sampling/masks.py``; a floor from each row's max (min-p's ``z_floor``) is its entry and its
    parameter, plus the integrations that map an engine's own field to it. The records, the
    scripts, both schedules, the reference and the planner take them from the registry."""
    from vocabpar.sampling.masks import MASKS
    from vocabpar.wire.filters import MASK_NAMES, Z_FLOORS

    assert MASK_NAMES and set(MASKS) == set(MASK_NAMES) and Z_FLOORS
    entry = {"vocabpar.wire.filters", "vocabpar.sampling.params"}
    integrations = {m for m in MODULES if m.startswith("vocabpar.integrations")}
    allowed = {name: entry | {"vocabpar.sampling.masks", MASKS[name].__name__} for name in MASK_NAMES}
    allowed |= {f.name: entry | integrations for f in Z_FLOORS}
    for name, where in allowed.items():
        naming = {m for m, path in MODULES.items() if name in _named_in_code(path)}
        assert naming <= where, f"{name} is named in the code of {sorted(naming - where)}"
    for name in MASK_NAMES:  # and only the table of masks calls a mask's module
        importers = {m for m in MODULES if MASKS[name].__name__ in _imports(m)}
        assert importers == {"vocabpar.sampling.masks"}, f"{MASKS[name].__name__} is imported by {importers}"


def _named_in_code(path: Path) -> set[str]:
    """Every name a module's code uses: identifiers, attributes, keywords, parameters and the words
    of its string constants (documentation -- a string standing alone as a statement -- left out)."""
    tree = ast.parse(path.read_text())
    prose = {id(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names |= {node.name.rpartition(".")[2], node.asname or ""}
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.keyword, ast.arg)) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            names |= set(re.findall(r"\w+", node.value))
    return names
