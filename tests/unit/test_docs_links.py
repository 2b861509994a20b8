"""The documentation points only at things that exist, and names what the code holds.

- every ``docs/...`` path named in a source or test file, or in README.md, exists;
- every relative Markdown link and image of README.md and of every page under docs/ (generated lab reports
  included) resolves: inline links and images, reference definitions and HTML <img>, outside code;
- every "docs/design/objectives.md §N" in the source names a section that the page has;
- every configuration key has a row in docs/config.md (generated: tests/unit/test_config_doc.py keeps it current);
- every function over 60 lines is named, with why, in docs/design/architecture.md's "Long functions";
- the README stays a front door (at most 250 lines).

The expectations come from the files on disk (the paths, headings, Config's fields, the AST), never from a list
kept in this test.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "trustbatch"
OBJECTIVES_PAGE = ROOT / "docs" / "design" / "objectives.md"
# A docs/ path not inside a longer path (``shared/docs/x.md`` is outside the repository, not ours).
DOCS_PATH = re.compile(r"(?<![\w./-])docs/[\w./-]*")
# [text](target "title") and ![alt](<target>): the target; reference definitions "[x]: target"; HTML <img src=...>
MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
MD_REF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?", re.M)
HTML_IMG = re.compile(r"<img[^>]*\ssrc=[\"']([^\"']+)[\"']", re.I)


def _py_files() -> list[Path]:
    return sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))


def _pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def _link_targets(text: str) -> list[str]:
    """Every link and image target of a Markdown page, outside fenced code blocks and inline code."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return MD_LINK.findall(text) + MD_REF.findall(text) + HTML_IMG.findall(text)


def _broken_links(pages: list[Path]) -> list[str]:
    broken = []
    for page in pages:
        for target in _link_targets(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a web address or an anchor in the same page
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page} -> {target}")
    return broken


def _docs_paths(text: str) -> set[str]:
    return {m.group(0).rstrip(".,;:") for m in DOCS_PATH.finditer(text)}


def test_path_pattern_finds_paths_and_skips_foreign_ones():
    text = ('see docs/design/objectives.md §1.2, "docs/lab" and (docs/guide/vllm.md). '
            "not shared/docs/scale-out.md nor area/docs/x.md")
    assert _docs_paths(text) == {"docs/design/objectives.md", "docs/lab", "docs/guide/vllm.md"}


def test_every_docs_path_named_in_code_and_readme_exists():
    named: dict[str, list[str]] = {}
    for f in [*_py_files(), ROOT / "README.md"]:
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for p in _docs_paths(line):
                named.setdefault(p, []).append(f"{f.relative_to(ROOT)}:{i}")
    assert "docs/design/objectives.md" in named  # the objectives' docstrings cite it
    missing = {p: where for p, where in named.items() if not (ROOT / p).exists()}
    assert not missing, f"docs paths that do not exist: {missing}"


def test_link_finder_reads_every_link_form_and_skips_code(tmp_path):
    (tmp_path / "there.png").write_bytes(b"png")
    page = tmp_path / "p.md"
    page.write_text('[a](there.png) ![b](gone.png "t") <img src="gone2.png"> [c](<gone3.md>) [w](https://x.org/y)\n'
                    "[ref]: gone4.md\n`[d](gone5.md)`\n```\n![e](gone6.png)\n```\n[f](there.png#part) [g](#here)\n")
    assert sorted(_link_targets(page.read_text())) == sorted(["there.png", "gone.png", "gone2.png", "gone3.md", "https://x.org/y",
                                                              "gone4.md", "there.png#part", "#here"])
    assert sorted(t.split(" -> ")[1] for t in _broken_links([page])) == ["gone.png", "gone2.png", "gone3.md", "gone4.md"]


def test_every_link_and_image_under_docs_and_in_the_readme_resolves():
    pages = _pages()
    assert ROOT / "docs" / "lab3" / "report" / "README.md" in pages  # the generated reports are pages too
    broken = _broken_links(pages)
    assert not broken, f"broken links: {broken}"


def _section_numbers(page: Path) -> set[str]:
    nums = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#{2,3} (\d+(?:\.\d+)?)\.? ", line)
        if m:
            nums.add(m.group(1))
    return nums


def test_section_references_to_the_objectives_page_exist():
    sections = _section_numbers(OBJECTIVES_PAGE)
    assert {"0", "1.1", "1.8", "3.9", "6"} <= sections  # the parser reads the page's numbering
    bad = []
    for f in sorted((ROOT / "src").rglob("*.py")):
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            _, sep, after = line.partition("docs/design/objectives.md")
            if not sep:
                continue
            cited = after.split(")")[0]  # "§1.3, §5)" or "§3.1–3.2)": the sections this path cites
            for num in re.findall(r"[§–](\d+(?:\.\d+)?)", cited):
                if num not in sections:
                    bad.append(f"{f.relative_to(ROOT)}:{i} §{num}")
    assert not bad, f"sections that docs/design/objectives.md does not have: {bad}"


def _config_keys() -> set[str]:
    from pydantic import BaseModel

    from trustbatch.config import Config

    def models_in(annotation) -> list[type]:
        try:
            if issubclass(annotation, BaseModel):
                return [annotation]
        except TypeError:  # not a class: a union, list[str], a Literal
            pass
        return [m for a in getattr(annotation, "__args__", ()) for m in models_in(a)]

    keys: set[str] = set()

    def walk(model: type, prefix: str) -> None:
        for name, field in model.model_fields.items():
            subs = models_in(field.annotation)
            if not subs or field.default is None:  # an optional section (model.lora) is a key itself
                keys.add(prefix + name)
            for sub in subs:
                walk(sub, f"{prefix}{name}.")

    walk(Config, "")
    return keys


def test_every_config_key_is_documented():
    keys = _config_keys()
    assert {"train.steps", "model.lora", "model.lora.r", "threads"} <= keys  # the walk reaches nested sections
    page = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    missing = sorted(k for k in keys if f"| `{k}` |" not in page)
    assert not missing, f"config keys without a row in docs/config.md: {missing}"


def _long_functions(limit: int = 60, src: Path = SRC) -> list[tuple[str, str, int]]:
    found = []
    for f in sorted(src.rglob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"))

        def visit(node, prefix=""):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = child.end_lineno - child.lineno + 1
                    if n > limit:
                        found.append((str(f.relative_to(src)), prefix + child.name, n))
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")

        visit(tree)
    return found


def test_every_function_over_60_lines_is_named_in_the_layout():
    text = (ROOT / "docs" / "design" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("### Long functions", 1)[1].split("\n## ", 1)[0]
    entries = [line for line in section.splitlines() if line.startswith("- ")]
    missing = [f"{path} {name} ({n} lines)" for path, name, n in _long_functions()
               if not any(f"`{path}`" in e and f"`{name}`" in e for e in entries)]
    assert not missing, f"functions over 60 lines not named in docs/design/architecture.md: {missing}"


def test_long_function_finder_counts_methods_and_lines(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(60))  # the def line + 60 = 61 lines
    (tmp_path / "m.py").write_text(f"class A:\n    def long(self):\n{body}\n\n    def short(self):\n        pass\n"
                                   "\ndef sixty():\n" + "\n".join(f"    y{i} = {i}" for i in range(59)) + "\n")
    assert _long_functions(60, tmp_path) == [("m.py", "A.long", 61)]


def test_readme_is_a_front_door():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= 250, f"README.md has {n} lines; move detail into docs/ (at most 250)"
