"""The package's layering as data, and a checker that walks every import of the package's sources.

Every import counts: at the top of a module, inside a function, or under ``TYPE_CHECKING``. A module's
layer is its first folder under the package (``ir``, ``planner``, ...), or the module itself for the
package's top-level files (``install``, ``__init__``).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "lightning_deeppool"

# Which layers each layer may import (besides itself), bottom to top. The graph is acyclic.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "ir": frozenset(),
    "private_files": frozenset(),
    "comm": frozenset(),
    "capture": frozenset({"ir"}),
    "planner": frozenset({"ir"}),
    "lowering": frozenset({"ir"}),
    "profiling": frozenset({"ir", "capture", "comm", "private_files"}),
    "spatial": frozenset({"ir", "capture", "comm"}),
    "runtime": frozenset({"ir", "capture", "lowering", "comm", "spatial"}),
    "install": frozenset({"ir", "capture", "planner", "lowering", "comm", "profiling", "spatial", "runtime"}),
    "session": frozenset({"ir", "planner", "comm", "runtime", "install"}),
    "strategy": frozenset({"ir", "planner", "comm", "runtime", "install", "session"}),
    "fabric": frozenset({"ir", "planner", "comm", "runtime", "install", "session"}),
    "background": frozenset({"planner", "runtime", "private_files"}),
    "cli": frozenset({"ir", "capture", "planner", "profiling"}),
    "__init__": frozenset({"strategy", "fabric", "background", "planner"}),
}
# Modules of another layer a layer may use, where it may not use the whole layer: the background
# trainers subscribe to the runtime's idle windows and read the plan, and keep their checkpoints as
# private files, nothing else.
ONLY: dict[str, frozenset[str]] = {
    "background": frozenset(
        {f"{PACKAGE}.runtime.idle", f"{PACKAGE}.planner.plan", f"{PACKAGE}.private_files"}
    ),
}
# Third-party packages only some layers may import.
TORCH_FREE = frozenset({"ir", "planner", "lowering"})
STDLIB_ONLY = frozenset({"ir", "private_files"})
LIGHTNING = frozenset({"strategy", "fabric", "background", "__init__"})


@dataclass(frozen=True)
class Import:
    """`module` (a file of the package) imports `target` at `line`."""

    module: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}"


def sources(root: Path) -> dict[str, str]:
    """Every module of the package under `root` (the folder holding the package), by dotted name."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path.read_text()
    return found


def imports(modules: Mapping[str, str]) -> Iterator[Import]:
    """Every import statement of every module, anywhere in its source."""
    for module, text in modules.items():
        package = module if _is_package(module, modules) else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Import(module, alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, package)
                # `from pkg import module` imports the module; `from module import name`, the module.
                targets = {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
                for target in sorted(targets):
                    yield Import(module, target, node.lineno)


def layer(module: str) -> str:
    """The layer of a module of the package."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def violations(modules: Mapping[str, str]) -> list[str]:
    """Every import that crosses the layering, described; empty when the package keeps it."""
    found = []
    for imp in imports(modules):
        mine = layer(imp.module)
        if imp.target.split(".")[0] == PACKAGE:
            theirs = layer(imp.target) if imp.target != PACKAGE else "__init__"
            if theirs == mine:
                continue
            if theirs not in MAY_IMPORT[mine]:
                found.append(f"{imp}: layer {mine!r} may not import layer {theirs!r}")
            elif mine in ONLY and not any(imp.target.startswith(m) for m in ONLY[mine]):
                found.append(f"{imp}: layer {mine!r} may import only {sorted(ONLY[mine])} of the package")
            continue
        top = imp.target.split(".")[0]
        if mine in STDLIB_ONLY and top not in sys.stdlib_module_names:
            found.append(f"{imp}: layer {mine!r} imports only the standard library")
        elif mine in TORCH_FREE and top == "torch":
            found.append(f"{imp}: layer {mine!r} must not import torch")
        elif top in ("lightning", "pytorch_lightning") and mine not in LIGHTNING:
            found.append(f"{imp}: only {sorted(LIGHTNING)} may import Lightning")
    return found


def imported_layers(modules: Mapping[str, str]) -> dict[str, set[str]]:
    """The layers of the package each layer imports (besides itself), as its modules do."""
    found: dict[str, set[str]] = {layer(m): set() for m in modules}
    for imp in imports(modules):
        if imp.target.split(".")[0] == PACKAGE:
            theirs = layer(imp.target) if imp.target != PACKAGE else "__init__"
            if theirs != layer(imp.module):
                found[layer(imp.module)].add(theirs)
    return found


def reached(edges: Mapping[str, set[str]], start: str) -> set[str]:
    """Every layer `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for succ in edges.get(todo.pop(), set()) - seen:
            seen.add(succ)
            todo.append(succ)
    return seen


def cycles(modules: Mapping[str, str]) -> list[list[str]]:
    """Groups of modules that import each other, directly or not (strongly connected components of
    more than one module, or a module importing itself)."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports(modules):
        if imp.target in modules and imp.target != imp.module:
            edges[imp.module].add(imp.target)
    return [sorted(c) for c in _components(edges) if len(c) > 1]


def layer_cycles() -> list[list[str]]:
    """Cycles in `MAY_IMPORT` itself."""
    edges = {name: set(allowed) for name, allowed in MAY_IMPORT.items()}
    return [sorted(c) for c in _components(edges) if len(c) > 1]


def _is_package(module: str, modules: Mapping[str, str]) -> bool:
    return any(other.startswith(module + ".") for other in modules)


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _components(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in edges.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            found.append(component)

    for node in edges:
        if node not in index:
            visit(node)
    return found
