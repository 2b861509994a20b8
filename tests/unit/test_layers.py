"""The floors of shared/docs/architecture.md, checked on every import of every module under src/trustbatch.

An AST pass (no module is imported) reads each ``import`` and ``from ... import`` anywhere in a file, lazy ones inside
functions and ``TYPE_CHECKING`` blocks included, relative and absolute, plus ``importlib.import_module`` calls with a
literal ``trustbatch.`` name. A module may import its own floor and the floors below, never one above.

Granularity of the cycle check: the module graph, one node per file (``pkg/__init__.py`` is the node ``pkg``). An edge
goes to the module an import names and, as Python runs them too, to the ``__init__`` of each package above it that
does not contain the importer (importing ``trustbatch.rollout.engine`` from ``pipeline`` runs ``rollout/__init__``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "trustbatch"

# ground floor first; a module's floor is that of its first name under ``trustbatch``
FLOORS = [
    ("errors", "interrupts", "processes", "parallel", "records", "seeding", "chat"),
    ("objectives", "advantages"),
    ("rewards", "adapters"),
    ("data",),
    ("config", "config_doc", "policy"),
    ("rollout",),
    ("pipeline", "eval"),
    ("trainer",),
    ("orchestration",),
    ("recipes",),
    ("lab",),
    ("cli", "__main__", "api"),
]
FLOOR = {name: i + 1 for i, names in enumerate(FLOORS) for name in names}


def _modules(src: Path = SRC) -> dict[str, Path]:
    """Dotted name (``trustbatch.pipeline.source``; a package is its ``__init__``) -> file."""
    mods = {}
    for path in sorted(src.rglob("*.py")):
        parts = ("trustbatch", *path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _is_package(name: str, mods: dict[str, Path]) -> bool:
    return mods[name].name == "__init__.py"


def _imported(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports, each as the deepest existing dotted name."""
    package = name if _is_package(name, mods) else name.rpartition(".")[0]
    targets = set()

    def add(dotted: str, members: list[str] = ()):
        for m in members:  # ``from pkg import mod`` names a module; ``from mod import func`` names the module
            if f"{dotted}.{m}" in mods:
                targets.add(f"{dotted}.{m}")
            elif dotted in mods:
                targets.add(dotted)
        if not members:
            while dotted and dotted not in mods:  # ``import trustbatch.a.b`` -> deepest existing module
                dotted = dotted.rpartition(".")[0]
            if dotted:
                targets.add(dotted)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "trustbatch":
                    add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                dotted = ".".join(base + ([node.module] if node.module else []))
            else:
                dotted = node.module or ""
            if dotted.split(".")[0] == "trustbatch":
                add(dotted, [a.name for a in node.names])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and node.args[0].value.startswith("trustbatch.")):
            add(node.args[0].value)
    return targets


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> modules its imports run (named ones and the ``__init__`` of packages above them it is outside of)."""
    mods = _modules(src)
    graph = {}
    for name, path in mods.items():
        edges = set()
        for target in _imported(name, path, mods):
            edges.add(target)
            parent = target.rpartition(".")[0]
            while parent.count("."):  # the root ``trustbatch`` contains everything
                if not (name == parent or name.startswith(parent + ".")):
                    edges.add(parent)
                parent = parent.rpartition(".")[0]
        edges.discard(name)
        graph[name] = edges
    return graph


def floor(module: str) -> int:
    """The floor of ``trustbatch.x...`` (the root package holds only its version: the ground floor)."""
    parts = module.split(".")
    return FLOOR[parts[1]] if len(parts) > 1 else 1


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})"
                  for a, targets in graph.items() for b in targets if floor(b) > floor(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_module_has_a_floor():
    unplaced = sorted(m for m in _modules() if m.count(".") and m.split(".")[1] not in FLOOR)
    assert not unplaced, f"add these to FLOORS (and to shared/docs/architecture.md): {unplaced}"


def test_no_module_imports_a_higher_floor():
    up = upward_imports(import_graph())
    assert not up, "upward imports:\n" + "\n".join(up)


def test_no_import_cycle_between_modules():
    found = cycles(import_graph())
    assert not found, "import cycles (modules of each):\n" + "\n".join(" ".join(c) for c in found)


def test_the_ground_floor_needs_only_torch_and_the_standard_library():
    ground = [p for m, p in _modules().items() if m.count(".") == 1 and FLOOR[m.split(".")[1]] == 1]
    assert len(ground) == len(FLOORS[0]), ground
    outside = set()
    for path in ground:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            outside |= {f"{path.name}: {n}" for n in names
                        if n.split(".")[0] not in (*sys.stdlib_module_names, "torch", "trustbatch")}
    assert not outside, sorted(outside)


# the checker itself, on small trees written here: each rule must be able to fire


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "trustbatch"
    for rel, text in {"__init__.py": "", **files}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    return src


def test_checker_sees_lazy_relative_and_absolute_upward_imports(tmp_path):
    src = _tree(tmp_path, {
        "errors.py": "def f():\n    from .cli import app\n",
        "objectives/__init__.py": "",
        "objectives/p3o.py": "import trustbatch.trainer.learner\n",
        "trainer/__init__.py": "",
        "trainer/learner.py": "from ..objectives import p3o\nfrom trustbatch import errors\n",
        "rewards/__init__.py": "import importlib\nimportlib.import_module('trustbatch.lab')\n",
        "lab/__init__.py": "",
        "cli.py": "from . import errors\n",
    })
    assert upward_imports(import_graph(src)) == [
        "trustbatch.errors (floor 1) imports trustbatch.cli (floor 12)",
        "trustbatch.objectives.p3o (floor 2) imports trustbatch.trainer (floor 8)",
        "trustbatch.objectives.p3o (floor 2) imports trustbatch.trainer.learner (floor 8)",
        "trustbatch.rewards (floor 3) imports trustbatch.lab (floor 11)",
    ]


def test_checker_finds_a_cycle_through_a_package_init_but_not_a_package_reexporting_its_own(tmp_path):
    src = _tree(tmp_path, {
        "policy/__init__.py": "from .model import Policy\n",
        "policy/model.py": "from .forward import f\n",
        "policy/forward.py": "from ..rollout.engine import Engine\n",
        "rollout/__init__.py": "from .engine import Engine\nfrom .hf import HF\n",
        "rollout/engine.py": "",
        "rollout/hf.py": "from ..policy.model import Policy\n",
    })
    assert cycles(import_graph(src)) == [[
        "trustbatch.policy", "trustbatch.policy.forward", "trustbatch.policy.model", "trustbatch.rollout",
        "trustbatch.rollout.hf"]]
    # the same tree without the engine's package running ``hf``: policy re-exporting its own model is no cycle
    (src / "rollout" / "__init__.py").write_text("")
    assert cycles(import_graph(src)) == []
