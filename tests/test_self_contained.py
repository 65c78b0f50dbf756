"""The repository carries every file its commands and tests read: nothing names a path above the
repository, and the prompts the demo, bench, autotune and train read resolve inside the package from
any working directory."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["specdraft", "tests", "scripts", "Makefile", ".ci"]
# A relative path that climbs out ("../x", "..\\x"), an absolute path into the workplace, or the aids
# folder that sits beside a checkout on the developers' machines.
OUTSIDE = re.compile(r"(?<![\w.])\.\.[/\\]|/work/|\bshared/data\b")
PARENTS = re.compile(r"\.parents\[(\d+)\]")


def checked_files():
    for name in CHECKED:
        p = ROOT / name
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
        yield from (f for f in files if f.suffix not in (".pyc", ".jsonl", ".png") and "__pycache__" not in f.parts)


def outside_references(files, root: Path = ROOT) -> list[str]:
    """'file:line: text' for each line that names a path outside the repository: a climbing relative
    path, or ``Path(__file__).parents[k]`` with k above the repository root for that file."""
    found = []
    for f in files:
        depth = len(f.relative_to(root).parts) - 1  # parents[depth] of a file is the repository root
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            above = any(int(k) > depth for k in PARENTS.findall(line)) and "__file__" in line
            if OUTSIDE.search(line) or above:
                found.append(f"{f.relative_to(root)}:{i}: {line.strip()}")
    return found


def test_no_file_names_a_path_above_the_repository():
    me = Path(__file__).resolve()
    assert outside_references(f for f in checked_files() if f != me) == []


def test_the_guard_catches_each_kind_of_outside_path(tmp_path):
    cases = {
        "a.py": 'p = Path("../beside/question.jsonl")\n',
        "b.py": "open('/work/beside/models.md')\n",
        "c.py": 'src = Path(__file__).resolve().parents[3] / "x"\n',
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    # the files sit at depth 1 below a pretend root: parents[1] is that root, parents[3] is above it
    found = outside_references(sorted(tmp_path.iterdir()), root=tmp_path.parent)
    assert [x.split(":")[0].split("/")[-1] for x in found] == ["a.py", "b.py", "c.py"]
    (tmp_path / "ok.py").write_text("from ..prompts import x\np = Path(__file__).resolve().parents[1]\n")
    assert outside_references([tmp_path / "ok.py"], root=tmp_path.parent) == []


def test_prompts_resolve_inside_the_package_from_an_empty_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SPECDRAFT_DATASET"}
    env["PYTHONPATH"] = str(ROOT)
    code = (
        "import specdraft, pathlib\n"
        "from specdraft.core.prompts import default_dataset, preset_rows, load_prompts\n"
        "p = default_dataset().resolve()\n"
        "assert pathlib.Path(specdraft.__file__).parent.resolve() in p.parents, p\n"
        "print(len(load_prompts()), len(preset_rows('core18')), len(preset_rows('core18+code_edit')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["480", "18", "27"]
