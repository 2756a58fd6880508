"""Imports run one way: each module of ``planner/``, ``profiling/`` and ``rewrite/`` imports only
from its own layer and the layers below it (docs/design.md#import-layers). Every ``import``
counts, at module level or inside a function, found by parsing the source; and the torch-free
layers, with the front doors that answer without torch, are imported with torch blocked."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "profiling", "rewrite")

#: Each layer's modules, by package or module name: a name stands for the modules under it, but
#: ``planner`` for its ``__init__`` alone (each module of the package is placed).
LAYERS: dict[str, tuple[str, ...]] = {
    "core": ("planner.core",),
    "milp": ("planner.milp",),
    "solvers": ("planner.solvers",),
    "bounds": ("planner.bounds",),
    "planning": ("planner.budget_plan", "planner.sweep", "planner.closed_loop", "planner.compiled_aim"),
    "profiling": ("profiling",),
    "rewrite": ("rewrite",),
    "steps": ("planner.capture_options", "planner.module_plan", "planner.graph_break_plan", "planner.graph_break_layers",
              "planner.uncaptured", "planner.compiled_plan", "planner.measured_fit", "planner.loss_chunking", "planner.rank_zero",
              "planner.planning_steps"),
    "front doors": ("planner", "planner.pipeline", "planner.cli", "planner.cli_arguments", "planner.cli_messages",
                    "planner.cli_options", "planner.cli_capture", "planner.report", "planner.plot", "planner.check",
                    "planner.testing", "planner.integrations"),
}

_TORCH_FREE = {"core", "milp", "solvers", "bounds", "planning"}
#: The layers each layer may import from, besides its own.
MAY_IMPORT: dict[str, set[str]] = {
    "core": set(),
    "milp": {"core"},
    "solvers": {"core", "milp"},
    "bounds": {"core", "milp", "solvers"},
    "planning": {"core", "milp", "solvers", "bounds"},
    "profiling": {"core"},
    "rewrite": {"core", "profiling"},
    "steps": _TORCH_FREE | {"profiling", "rewrite"},
    "front doors": set(LAYERS),
}

#: Front doors that load without torch: ``import planner``, and the CLI until a command runs a model.
FRONT_DOORS_WITHOUT_TORCH = ("planner", "planner.cli", "planner.cli_arguments",
                             "planner.cli_options", "planner.capture_options", "planner.report", "planner.plot", "planner.check")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> str | None:
    """The layer of ``module``: the one naming it or, failing that, its closest package."""
    best, best_length = None, -1
    for layer, names in LAYERS.items():
        for name in names:
            under = module.startswith(name + ".") and name != "planner"
            if (module == name or under) and len(name) > best_length:
                best, best_length = layer, len(name)
    return best


def imports_of(module: str, path: Path) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import in ``path``, relative ones resolved and
    ``from package import module`` read as the module."""
    is_package = path.name == "__init__.py"
    imported = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            imported += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                inner = f"{base}.{alias.name}"
                imported.append((inner if inner in MODULES else base, node.lineno))
    return imported


def test_every_module_has_a_layer():
    missing = sorted(module for module in MODULES if layer_of(module) is None)
    assert not missing, f"modules in no layer (add them to LAYERS here and to docs/design.md#import-layers): {missing}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_down_the_layers(module):
    layer = layer_of(module)
    if layer is None:
        pytest.skip("in no layer: test_every_module_has_a_layer names it")
    allowed = MAY_IMPORT[layer] | {layer}
    wrong = []
    for target, line in imports_of(module, MODULES[module]):
        top = target.split(".")[0]
        if top in PACKAGES:
            target_layer = layer_of(target)
            if target_layer not in allowed:
                wrong.append(f"line {line}: {target} ({target_layer})")
        elif top == "torch" and layer in _TORCH_FREE:
            wrong.append(f"line {line}: {target} (torch, in a torch-free layer)")
    assert not wrong, f"{module} ({layer}) may import only from {sorted(allowed)}: " + "; ".join(wrong)


def test_the_layers_name_real_modules_and_the_design_lists_them():
    for names in LAYERS.values():
        for name in names:
            assert name in MODULES, f"LAYERS names {name}, which does not exist"
    design = (ROOT / "docs" / "design.md").read_text()
    assert "## Import layers" in design
    section = design.split("## Import layers", 1)[1].split("\n## ", 1)[0]
    missing = [layer for layer in LAYERS if f"| {layer} |" not in section]
    assert not missing, f"docs/design.md#import-layers has no row for {missing}"


def test_torch_free_layers_and_front_doors_import_with_torch_blocked():
    names = sorted(m for m in MODULES if layer_of(m) in _TORCH_FREE) + list(FRONT_DOORS_WITHOUT_TORCH)
    code = ("import importlib, sys\nsys.modules['torch'] = None\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            "from planner.cli_arguments import build_parser\nbuild_parser().parse_args(['plan', 'm:f', '--budget-gb', '1'])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
