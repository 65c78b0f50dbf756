"""No module-level import cycles inside specdraft, every module imports on its own, and layers import
downward only, inside functions included (LAYERS, docs/design.md "Architecture at a glance").

The graph: an edge a -> b for each ``import`` / ``from ... import`` of a specdraft module that runs when
a is imported (module top level, including ``if``/``try`` blocks but not ``if TYPE_CHECKING:``; imports
inside functions run later and are not edges). ``from .x import name`` is an edge to x;
``from . import x`` is an edge to x when x is a submodule (else to the package, whose name it reads).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import specdraft

PKG = Path(specdraft.__file__).resolve().parent
ROOT = PKG.parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _is_package(mod: str, mods: dict[str, Path]) -> bool:
    return mods[mod].name == "__init__.py"


def _top_level_imports(tree: ast.Module):
    """Import nodes that run at import time (not in functions, classes' methods or TYPE_CHECKING blocks)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if test not in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                stack.extend(node.body)
            stack.extend(node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
        elif isinstance(node, (ast.With, ast.ClassDef)):
            stack.extend(node.body)


def _resolve(mod: str, node: ast.ImportFrom, mods) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if _is_package(mod, mods) else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(mod, node, mods)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


# Bottom to top: the folders are the layers (docs/design.md, "The folders are the layers"), and the
# top-level modules are the engine, the library's API and the front ends. A module may import from its
# own layer and the layers below, never from one above, at module level or inside a function. A name
# covers itself and its submodules, but "specdraft" is the package's __init__ only.
LAYERS = [
    ("core", ["specdraft.core"]),
    ("models", ["specdraft.models"]),
    ("scale", ["specdraft.scale"]),
    ("drafters", ["specdraft.drafters"]),
    ("engine", ["specdraft.engine"]),
    ("api", ["specdraft.api", "specdraft.learning", "specdraft"]),
    ("commands", ["specdraft.commands"]),
    ("bench", ["specdraft.bench"]),
    ("server", ["specdraft.server"]),
    ("tools", ["specdraft.tools"]),
    ("front", ["specdraft.demo", "specdraft.cli"]),
]


# Cycles left inside one layer (none now: models.loading no longer dispatches to the backend table, whose
# load_model it was). A new cycle fails test_no_new_import_cycles.
KNOWN_CYCLES: list[set[str]] = []


def layer_of(mod: str) -> int:
    best = (-1, -1)  # (length of the matching name, layer)
    for i, (_, names) in enumerate(LAYERS):
        for n in names:
            if (mod == n or (n != "specdraft" and mod.startswith(n + "."))) and len(n) > best[0]:
                best = (len(n), i)
    return best[1]


def _every_import(tree: ast.Module):
    """(import node, inside a function?) for every import anywhere in the module, but those under
    ``if TYPE_CHECKING:`` (type hints only: they never run)."""
    stack = [(n, False) for n in tree.body]
    while stack:
        node, in_fn = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_fn
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            stack.extend((c, in_fn) for c in node.orelse)
            continue
        in_fn = in_fn or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((c, in_fn) for c in ast.iter_child_nodes(node))


def _targets(mod: str, node, mods) -> list[str]:
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = _resolve(mod, node, mods)
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    return [t for t in targets if t in mods and t != mod]


def import_edges() -> list[tuple[str, str, bool]]:
    """(importer, imported, inside a function?) for every import of a specdraft module, at any depth."""
    mods = _modules()
    edges = []
    for mod, path in mods.items():
        for node, in_fn in _every_import(ast.parse(path.read_text(), str(path))):
            edges += [(mod, t, in_fn) for t in _targets(mod, node, mods)]
    return edges


def full_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in _modules()}
    for a, b, _ in import_edges():
        graph[a].add(b)
    return graph


def upward_edges() -> list[str]:
    return sorted(
        {
            f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
            for a, b, _ in import_edges()
            if layer_of(b) > layer_of(a)
        }
    )


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(m):
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            group = set()
            while m not in group:
                group.add(stack.pop())
            if len(group) > 1:
                found.append(group)

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    color = {m: 0 for m in graph}  # 0 new, 1 on the stack, 2 done
    path: list[str] = []

    def visit(m):
        color[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if color[n] == 1:
                return path[path.index(n) :] + [n]
            if color[n] == 0:
                c = visit(n)
                if c:
                    return c
        path.pop()
        color[m] = 2
        return None

    for m in sorted(graph):
        if color[m] == 0:
            c = visit(m)
            if c:
                return c
    return None


def test_no_module_level_import_cycles():
    graph = import_graph()
    assert "specdraft.core.sampling" in graph and "specdraft.core.config" in graph
    assert "specdraft.core.config" not in graph["specdraft.core.sampling"]  # type hints only (TYPE_CHECKING)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_module_has_a_layer():
    assert [m for m in _modules() if layer_of(m) < 0] == []


def test_the_layers_are_the_folders():
    """Each layer is one folder or one top-level module, and only the engine, the API and the front ends
    sit at the top level: a new module goes into the folder of its layer."""
    names = [n for _, ns in LAYERS for n in ns]
    assert len(names) == len(set(names))
    top = sorted(m for m in _modules() if m.count(".") == 1 and not _is_package(m, _modules()))
    assert top == ["specdraft.api", "specdraft.cli", "specdraft.demo", "specdraft.engine"]
    folders = sorted(m for m in _modules() if m.count(".") == 1 and _is_package(m, _modules()))
    assert folders == sorted(n for n in names if n.count(".") == 1 and n not in top)


def test_layers_import_downward_only_inside_functions_too():
    assert upward_edges() == []


def test_no_new_import_cycles():
    assert [sorted(c) for c in cycles(full_graph()) if c not in KNOWN_CYCLES] == []


def test_the_checker_sees_imports_in_functions_and_skips_type_only_ones():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
        "def f():\n    g = lambda: __import__('x')\n    import b\nimport c\n"
    )
    assert sorted((n.names[0].name, in_fn) for n, in_fn in _every_import(tree)) == [
        ("TYPE_CHECKING", False),
        ("b", True),
        ("c", False),
    ]
    assert cycles({"a": {"b"}, "b": {"a", "c"}, "c": set()}) == [{"a", "b"}]
    assert layer_of("specdraft.drafters.suffix") == layer_of("specdraft.drafters") < layer_of("specdraft.engine")
    assert layer_of("specdraft.unlisted") == -1


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """Each module first (no other specdraft module loaded before it), in one fresh interpreter:
    sys.modules is cleared of specdraft between imports, so a module that only works when imported
    after another one (a cycle resolved by luck of order) fails here."""
    skip = {
        "specdraft.server.app",
        "specdraft.server.batch_worker",
        "specdraft.server.front",
        "specdraft.server.scheduler",
        "specdraft.server.prometheus",
        "specdraft.server.protocol",
        "specdraft.server",
        "specdraft.server.replicas",
    }
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401

        skip = set()
    except ImportError:
        pass
    mods = [m for m in _modules() if m not in skip]
    code = (
        "import importlib, sys, traceback\n"
        f"mods = {mods!r}\n"
        "bad = []\n"
        "for m in mods:\n"
        "    for k in [k for k in sys.modules if k == 'specdraft' or k.startswith('specdraft.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def test_command_line_parsing_lives_in_the_command_layers():
    """argparse (the flags) is the commands' and the front ends' business: the layers below them, the
    drafters included, build typed settings only (their flags live in commands/flags.py)."""
    below = {m for m in _modules() if layer_of(m) < layer_of("specdraft.commands")}
    found = sorted(
        m
        for m, path in _modules().items()
        if m in below
        for node, _ in _every_import(ast.parse(path.read_text()))
        if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names)
    )
    assert found == ["specdraft.models.llama_setup"]  # the llama.cpp installer's own script entry
