"""What the design forbids (shared/docs/scale-out.md, "What must not happen"), checked on the source."""

import ast
import io
from pathlib import Path

from rich.console import Console

SRC = Path(__file__).resolve().parents[2] / "src" / "trustbatch"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names |= {f"{node.module}.{a.name}" for a in node.names} | {node.module or ""}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_the_loop_is_short_and_reads_no_config():
    loop = SRC / "trainer" / "loop.py"
    assert len(loop.read_text().splitlines()) <= 150
    assert not any("config" in name.lower() for name in _imports(loop)), _imports(loop)
    # no backend or objective is named in the code (docstrings may explain what plugs in)
    tree = ast.parse(loop.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    words = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    words |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    words |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
              and id(n) not in docstrings}
    for word in ("async", "ray", "vllm", "p3o", "grpo", "objective", "orchestrator"):
        assert not any(word in w.lower() for w in words), word


def test_only_the_recipes_the_cli_and_the_api_read_config_below_the_top():
    readers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                     if any(n.endswith(("config.Config", "config.load_config")) or n == "..config.Config"
                            for n in _imports(p)) or "from ..config import Config" in p.read_text())
    allowed = ("recipes/", "cli.py", "api.py", "lab/", "config/")
    assert all(r.startswith(allowed) for r in readers), readers


def test_progress_prints_plain_lines_when_not_a_terminal():
    from trustbatch.trainer.progress import Progress

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    with Progress(console, total=40) as progress:
        for r in range(1, 41):
            progress.advance(r, f"reward {r / 40:.3f}")
    lines = [l for l in buf.getvalue().splitlines() if l.strip()]
    assert lines and all(l.startswith("round ") for l in lines)
    assert lines[-1].startswith("round 40/40  reward 1.000")
    assert 2 <= len(lines) <= 25  # a line every few rounds, not one per round, and not none


def test_only_the_adapters_import_trl_and_verl():
    stacks = ("trl", "verl")
    importers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                       if any(n.split(".")[0] in stacks for n in _imports(p))
                       or any(f'import_stack("{s}' in p.read_text() for s in stacks))
    assert all(r.startswith("adapters/") and r != "adapters/__init__.py" for r in importers), importers
