"""The import contract: folders are layers and imports flow one way, with no cycle.

Every ``import`` in every module counts, the ones inside functions too (they are how a layer
defers loading torch, not a licence to reach upwards). Read from the source with ``ast``, so the
check needs nothing installed and cannot be fooled by what happens to be imported already.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "cerar"

#: Lower layers first; a module may import its own layer and the layers before it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cerar._cache", "cerar._checks", "cerar._files", "cerar._version"),
    ("cerar.coding",),
    ("cerar.protocol",),
    ("cerar.comm",),  # the package itself: its docstring only
    ("cerar.comm.runtime",),  # who talks to whom: links, the round engine, handshake, maxima, stats, the thread
    ("cerar.comm.algorithms",),  # one rank's runs: CERAR (compiled or torch ops), the exact ring, the packet scale
    ("cerar.comm.collective",),  # the public calls: argument checks, one call's body, the hierarchical path
    ("cerar.comm.ddp",),  # DDP: hooks, states, checkpoints, replicas
    ("cerar.comm.auto",),  # method="auto", above everything it chooses among
    ("cerar.comm.group",),  # cerar as a process group: it offers every method, auto included
    ("cerar.harness",),
    ("cerar.experiments",),
    ("cerar.cli", "cerar.__main__"),
)
#: Third-party packages each layer may not import (the base install is numpy, scipy, torch).
FORBIDDEN = {
    "cerar.coding": ("torch", "matplotlib", "tqdm", "transformers"),
    "cerar.protocol": ("torch", "matplotlib", "tqdm", "transformers"),
    "cerar.comm": ("matplotlib", "tqdm", "transformers"),
    "cerar.harness": ("matplotlib", "tqdm", "transformers"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import statement in module ``name``."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                # ``from cerar.coding import codes`` imports the module cerar.coding.codes.
                found.append((full if full in MODULES else base, node.lineno))
    return found


def _layer(name: str) -> int:
    """The layer of the longest prefix that holds ``name`` (``cerar.comm.runtime`` before ``cerar.comm``)."""
    matches = [
        (len(p), index) for index, prefixes in enumerate(LAYERS) for p in prefixes
        if name == p or name.startswith(p + ".")
    ]  # fmt: skip
    if not matches:
        raise AssertionError(f"module {name} belongs to no layer: add its folder to LAYERS")
    return max(matches)[1]


def _internal_graph() -> dict[str, set[str]]:
    return {
        name: {target for target, _ in _imports(name) if target in MODULES and target != name}
        for name in MODULES
    }


#: The facade: ``cerar`` and its re-export modules sit above every layer; nothing inside imports them.
FACADE = (
    "cerar", "cerar.codes", "cerar.collective", "cerar.ddp", "cerar.group", "cerar.hierarchical", "cerar.transport",
)  # fmt: skip


def test_every_module_belongs_to_a_layer() -> None:
    for name in MODULES:
        if name not in FACADE:
            _layer(name)


def test_imports_flow_one_way() -> None:
    wrong = []
    for name in MODULES:
        if name in FACADE:
            continue  # the facade re-exports from every layer
        for target, line in _imports(name):
            if target in FACADE and name != "cerar.__main__":
                wrong.append(f"{name}:{line} imports the facade {target!r} (import the module that defines the name)")
            elif target in MODULES and _layer(target) > _layer(name):
                wrong.append(f"{name}:{line} imports {target}, a higher layer")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle() -> None:
    graph = _internal_graph()
    for name in FACADE:
        graph.pop(name, None)  # the facade sits above everything and nothing imports it
    # Tarjan's strongly connected components: any component of two or more modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_dependencies(layer: str) -> None:
    wrong = [
        f"{name}:{line} imports {target}"
        for name in MODULES
        if name == layer or name.startswith(layer + ".")
        for target, line in _imports(name)
        if target.split(".")[0] in FORBIDDEN[layer]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_parser_resolves_what_the_checks_rely_on() -> None:
    # A contract that parsed nothing would pass everything: pin the forms it must see.
    facade = {target for target, _ in _imports("cerar")}
    assert "cerar.codes" in facade  # ``from cerar import codes``: the submodule
    assert "cerar.coding.linear_code" in facade  # ``from cerar.coding.linear_code import Code``: the module
    assert any(target.startswith("torch") for target, _ in _imports("cerar.comm.collective.api"))
    assert _layer("cerar.coding.linear_code") < _layer("cerar.comm.collective.api") < _layer("cerar.cli")
    assert _layer("cerar.comm") < _layer("cerar.comm.runtime.links") < _layer("cerar.comm.algorithms.cerar.run")
    assert _layer("cerar.comm.ddp.hooks") < _layer("cerar.comm.auto.ddp") < _layer("cerar.harness.launch")


def test_every_comm_folder_is_a_layer() -> None:
    # A new folder under comm/ must say where it sits: it would otherwise fall to cerar.comm's layer.
    layered = {p for prefixes in LAYERS for p in prefixes}
    folders = {f"cerar.comm.{p.name}" for p in (PACKAGE / "comm").iterdir() if (p / "__init__.py").exists()}
    assert folders <= layered, sorted(folders - layered)
