"""The rooms of the in-image package: which folder may import which (the layering), no two folders importing each
other (a loop closed by an import inside a function counts), and no folder of trainbox/training/ over 15 modules.

Imports are read with ast (nothing runs), inside functions too. A folder is a package's own modules, its subpackages
apart: trainbox.training (the trainer library's root: the run skeleton, options, data, planning, the kernel choice)
is one room, trainbox.training.grpo and trainbox.training.kernels are two more.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "trainbox"
MAX_MODULES = 15

# room -> the rooms it may import (its own modules always; common/ and libraries are outside this table). Data flows
# down: the commands over the trainer library; GRPO's room over the library's root; the root over the kernels; a
# run's life and the image's facts below the library (the image's doctor reads the kernel choice).
MAY_IMPORT = {
    "trainbox.cli": {"trainbox", "trainbox.training", "trainbox.training.grpo", "trainbox.training.kernels",
                     "trainbox.run", "trainbox.image"},
    "trainbox.training.grpo": {"trainbox", "trainbox.training", "trainbox.training.kernels", "trainbox.run"},
    "trainbox.training": {"trainbox", "trainbox.training.kernels", "trainbox.run"},
    "trainbox.training.kernels": set(),
    "trainbox.image": {"trainbox", "trainbox.training", "trainbox.training.kernels", "trainbox.run"},
    "trainbox": {"trainbox.run"},  # the dispatcher (cache folders first), the help cache, quiet: commands by name
    "trainbox.run": set(),
}


def room_of(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).parent.parts)


def module_room(name: str, root: Path) -> str | None:
    """The room (package) that module NAME's file is in; None if NAME is no module of ours (a function)."""
    base = root.joinpath(*name.split("."))
    if (base / "__init__.py").is_file():
        return name
    if base.with_suffix(".py").is_file():
        return name.rpartition(".")[0]
    return None


def imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """(module, names imported from it, inside a function?) for every import of ours in PATH."""
    out = []

    def visit(node, nested):
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, [], inner) for a in child.names if a.name.split(".")[0] == IMAGE)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module \
                    and child.module.split(".")[0] == IMAGE:
                out.append((child.module, [a.name for a in child.names], inner))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


def room_edges(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(room, another room it imports) -> the imports that make the edge (`from a.b import c`: c's room when c is a
    module or a package, else a.b's)."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted((root / IMAGE).rglob("*.py")):
        here = room_of(path, root)
        for module, names, lazy in imports(path):
            targets = {n: module_room(f"{module}.{n}", root) for n in names}
            found = [(f"{module}.{n}", r) for n, r in targets.items() if r] or [(module, module_room(module, root))]
            for name, there in found:
                if there and there != here and not (path.name == "__init__.py" and there.startswith(here)):
                    edges.setdefault((here, there), []).append(
                        f"{path.relative_to(root)} imports {name}{' (inside a function)' if lazy else ''}")
    return edges


def wrong_way(root: Path = ROOT) -> list[str]:
    found = []
    for (a, b), where in sorted(room_edges(root).items()):
        allowed = MAY_IMPORT.get(a)
        if allowed is None:
            found.append(f"{a} is a room without a row in MAY_IMPORT (say which rooms it may import): {where[0]}")
        elif b not in allowed:
            found.append(f"{a} may not import {b}: {'; '.join(where)}")
    return found


def room_loops(root: Path = ROOT) -> list[list[str]]:
    """Pairs and longer circles of rooms importing each other (strongly connected components of the room graph)."""
    graph: dict[str, set[str]] = {}
    for a, b in room_edges(root):
        graph.setdefault(a, set()).add(b)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_room_imports_only_the_rooms_below_it():
    edges = room_edges()
    assert ("trainbox.cli", "trainbox.training") in edges  # the check sees the real imports
    assert wrong_way() == []


def test_no_two_rooms_import_each_other_even_inside_a_function():
    assert room_loops() == []


def test_no_room_of_the_trainer_library_is_over_15_modules():
    for folder in [ROOT / IMAGE / "training", *(p.parent for p in (ROOT / IMAGE / "training").rglob("*/__init__.py"))]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= MAX_MODULES, (f"{folder.relative_to(ROOT)} holds {len(modules)} modules: split it "
                                             f"into rooms by kind (at most {MAX_MODULES} each)")


def test_the_checks_catch_a_planted_wrong_way_import_and_a_lazy_loop(tmp_path):
    def plant(rel, text=""):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        for parent in p.relative_to(tmp_path).parents:
            if str(parent) != ".":
                (tmp_path / parent / "__init__.py").touch()
        p.write_text(text)

    plant("trainbox/training/kernels/k.py", "import os\n")
    plant("trainbox/training/grpo/g.py", "from trainbox.training.kernels import k\n")
    plant("trainbox/training/lib.py", "from trainbox.training.kernels import k\n")
    assert wrong_way(tmp_path) == [] and room_loops(tmp_path) == []
    # a kernel importing GRPO's room: the wrong way
    plant("trainbox/training/kernels/bad.py", "from trainbox.training.grpo import g\n")
    assert wrong_way(tmp_path) == ["trainbox.training.kernels may not import trainbox.training.grpo: "
                                   "trainbox/training/kernels/bad.py imports trainbox.training.grpo.g"]
    assert room_loops(tmp_path) == [["trainbox.training.grpo", "trainbox.training.kernels"]]
    (tmp_path / "trainbox/training/kernels/bad.py").unlink()
    # a loop between the library and a run's life, closed by an import inside a function
    plant("trainbox/run/summary.py", "def f():\n    from trainbox.training import lib\n")
    plant("trainbox/training/lib.py", "from trainbox.run import summary\n")
    assert room_loops(tmp_path) == [["trainbox.run", "trainbox.training"]]
    assert any("trainbox.run may not import trainbox.training" in w and "(inside a function)" in w
               for w in wrong_way(tmp_path))
    # a room nobody placed
    plant("trainbox/training/newroom/x.py", "from trainbox.training import lib\n")
    assert any("trainbox.training.newroom is a room without a row" in w for w in wrong_way(tmp_path))


@pytest.mark.parametrize("room", sorted(MAY_IMPORT))
def test_every_room_in_the_table_exists(room):
    assert (ROOT.joinpath(*room.split(".")) / "__init__.py").is_file(), f"{room}: no such package"
