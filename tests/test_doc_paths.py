"""Every module or file of this repository that a doc (README.md, CONTRIBUTING.md, docs/*.md) or a string
of the package (a message, a docstring, a help text) names exists: ``specdraft.bench.shard``,
``bench.shard.run_sharded``, ``specdraft/models/llama.py``, ``models/llama.py``, ``docs/results/x_*.json``.
A dotted name may end in a name the module defines (read from its source: nothing is imported). Paths
under ``results/`` (what a command writes) and the models' home are not checked; ALLOWED lists the few
names that stand for a file still to be written."""

from __future__ import annotations

import ast
import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "specdraft"
SUBPACKAGES = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").exists())
ALLOWED = {
    "specdraft/drafters/repeat_last.py": "docs/design.md's worked example of a drafter to add",
    "specdraft.drafters.repeat_last": "the same example, as the module its table entry names",
}
FILE_SUFFIXES = (".json", ".jsonl", ".md", ".txt", ".yaml", ".yml", ".png", ".safetensors", ".gguf", ".log", ".pt")
_SUBS = "|".join(SUBPACKAGES)
# specdraft.a.b(.name) and a.b(.name) for a subpackage a; not inside a longer name, a path or a URL
DOTTED = re.compile(rf"(?<![\w./-])(?:specdraft|{_SUBS})(?:\.[A-Za-z_]\w*)+")
# specdraft/..., tests/..., scripts/..., docs/... and a/b.py for a subpackage a (globs and {x,y} allowed)
PATH = re.compile(rf"(?<![\w./-])(?:(?:specdraft|tests|scripts|docs)/[\w./*{{}},$-]*[\w*}}]|(?:{_SUBS})/[\w/]*\.py)")


def texts():
    """(where, text): each doc whole, and each string constant of the package's modules."""
    for f in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if f.exists():
            yield f.relative_to(ROOT), f.read_text()
    for f in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield f"{f.relative_to(ROOT)}:{node.lineno}", node.value


def defines(module: Path, name: str) -> bool:
    """Whether ``module``'s top level binds ``name`` (def, class, assignment, import)."""
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


def dotted_exists(name: str) -> bool:
    parts = name.split(".")
    where = ROOT if parts[0] == "specdraft" else PKG
    for i, part in enumerate(parts):
        if (where / part / "__init__.py").exists():
            where = where / part
        elif (where / f"{part}.py").exists():
            return i + 1 == len(parts) or defines(where / f"{part}.py", parts[i + 1])
        else:
            return defines(where / "__init__.py", part)
    return True


def path_exists(path: str) -> bool:
    path = path.rstrip(".,")
    if "$" in path or re.search(r"(^|/)[A-Z]{3,}(\.|/|$)", path):  # a shell variable or a placeholder (NAME.py)
        return True
    m = re.search(r"\{([^{}]*)\}", path)  # {a,b}: each must exist
    if m:
        return all(path_exists(path[: m.start()] + alt + path[m.end() :]) for alt in m[1].split(","))
    return any(bool(glob.glob(str(base / path))) for base in (ROOT, PKG))


def missing_names(where, text: str) -> list[str]:
    out = [
        d for d in DOTTED.findall(text) if not d.endswith(FILE_SUFFIXES) and d not in ALLOWED and not dotted_exists(d)
    ]
    out += [p for p in PATH.findall(text) if p.rstrip(".,") not in ALLOWED and not path_exists(p)]
    return [f"{where}: {n}" for n in out]


def test_every_named_module_and_file_exists():
    missing = [m for where, text in texts() for m in missing_names(where, text)]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize(
    "text",
    [
        "run_bench(opts, scale.shard.run_sharded)",
        "see specdraft.server.metrics",
        "(specdraft/commands/train.py)",
        "docs/results/nothing_*.json",
        "models/nowhere.py",
        "specdraft.bench.shard.no_such_function",
    ],
)
def test_a_wrong_name_is_found(text):
    assert missing_names("planted", text), text


@pytest.mark.parametrize(
    "text",
    [
        "specdraft.bench.shard.run_sharded",
        "bench.shard",
        "models/llama.py",
        "specdraft/commands/train/",
        "docs/results/llama/*.json",
        "specdraft.json",
        "docs/results/qwen_fp32_batch_crossover.{json,png}",
        "docs/results/x/NAME.py",
    ],
)
def test_a_right_name_passes(text):
    assert not missing_names("planted", text), text


def listed_modules(package: Path) -> list[str]:
    """The ``name`` of each ``- ``name``...`` bullet of a package's docstring: its modules, one a bullet."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return [
        n for line in doc.splitlines() if line.startswith("- ``") for n in re.findall(r"``(\w+)``", line.split(":")[0])
    ]


def test_package_docstrings_list_modules_that_exist():
    missing = [
        f"{p.relative_to(ROOT)}: {n}"
        for p in [PKG, *PKG.rglob("*/")]
        if (p / "__init__.py").exists()
        for n in listed_modules(p)
        if not (p / f"{n}.py").exists() and not (p / n / "__init__.py").exists()
    ]
    assert not missing, missing
