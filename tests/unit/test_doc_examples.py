"""Every ``trustbatch ...`` command that README.md and docs/ show parses (issue 45 item 9).

A command in a fenced code block is parsed as the CLI parses it (click's ``make_context``: subcommand, option names,
arity, value types, required options; nothing runs), and a ``train`` command that starts a run is resolved as
``trustbatch train --print-config`` resolves it (every config key and value checked). A command quoted inline in the
text is often a fragment (``trustbatch eval``), so there only the subcommand and the option names are checked.

How a line is read: ``#`` starts a comment; ``\\`` continues the line; ``[...]`` groups of a synopsis are optional and
dropped, ``a|b`` alternatives give the first; ``...`` (more arguments) is dropped, and the command may then lack a
required argument. Placeholders in capitals stand for a value of the reader's: a path is taken as it is (nothing is
opened), a number (``N``, ``M``, ``SEED``) is given as 2.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from trustbatch.cli import app
from trustbatch.errors import UserError
from trustbatch.cli import _one_config
from trustbatch.recipes.train import resolved_config

ROOT = Path(__file__).resolve().parents[2]
COUNTS = {"N": "2", "M": "2", "SEED": "2"}  # placeholders that a key or option reads as an integer


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def examples() -> list[tuple[str, str, bool]]:
    """``(where, command line, inline)`` for every trustbatch command of the pages."""
    out = []
    for page in _pages():
        lines = page.read_text(encoding="utf-8").splitlines()
        block, i = False, 0
        while i < len(lines):
            line, where = lines[i], f"{page.relative_to(ROOT)}:{i + 1}"
            if line.lstrip().startswith("```"):
                block = not block
            elif block:
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                if re.search(r"(^|\s)trustbatch\s", line) and not line.lstrip().startswith(("#", "from ", "pip ")):
                    out.append((where, line.strip(), False))
            else:
                out += [(where, m.group(1), True) for m in re.finditer(r"`(trustbatch [^`]+)`", line)]
            i += 1
    return out


def argv_of(line: str) -> tuple[list[str], bool]:
    """The arguments after ``trustbatch`` (env assignments, ``torchrun ... -m`` and comments aside), and whether the
    line left some out (``...``)."""
    line = re.sub(r"(?<=\w)(\|[\w-]+)+", "", line)  # run|preflight|report: the first alternative
    tokens = shlex.split(line, comments=True)
    tokens = tokens[tokens.index("trustbatch") + 1:]
    argv, depth, elided = [], 0, False
    for t in tokens:
        if depth > 0 or t.startswith("["):  # an optional group of a synopsis, up to the token that closes it
            depth += t.count("[") - t.count("]")
        elif t == "...":
            elided = True
        else:
            key, eq, value = t.partition("=")
            argv.append(COUNTS.get(t) or (f"{key}={COUNTS[value]}" if eq and value in COUNTS else t))
    return argv, elided


def check(argv: list[str], inline: bool = False, elided: bool = False) -> None:
    """Raise if ``trustbatch *argv`` does not parse (``inline``: the subcommand and option names only)."""
    cmd, path = typer.main.get_command(app), ["trustbatch"]
    while hasattr(cmd, "commands"):  # a group: the next word names its command
        if inline and not argv:
            return  # the text names the group (`trustbatch lab`)
        assert argv and argv[0] in cmd.commands, f"{' '.join(path)} has no command {argv[:1]}"
        path.append(argv[0])
        cmd, argv = cmd.commands[argv[0]], argv[1:]
    if inline:
        names = {"--help"} | {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        unknown = [t.split("=")[0] for t in argv if t.startswith("-") and t.split("=")[0] not in names]
        assert not unknown, f"{' '.join(path)} has no option {unknown[0]}"
        return
    try:
        params = cmd.make_context(" ".join(path), list(argv)).params
    except Exception as e:  # click's (typer's vendored) usage errors
        if elided and type(e).__name__ == "MissingParameter":
            return  # the line's "..." stands for it
        raise AssertionError(f"{' '.join(path + argv)}: {type(e).__name__}: {e}") from None
    if path[1:] == ["train"] and not params.get("resume"):
        try:
            resolved_config(_one_config(params.get("config")), params.get("overrides"))
        except UserError as e:
            raise AssertionError(f"{' '.join(path + argv)}: {e}") from None


EXAMPLES = examples()


def test_the_pages_show_commands():
    blocks = [e for e in EXAMPLES if not e[2]]
    assert len(blocks) > 60 and len(EXAMPLES) - len(blocks) > 60, (len(blocks), len(EXAMPLES))


@pytest.mark.parametrize("where, line, inline", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_every_documented_command_parses(where, line, inline, monkeypatch):
    monkeypatch.chdir(ROOT)  # --config examples/... is relative to the checkout
    argv, elided = argv_of(line)
    check(argv, inline=inline, elided=elided)


@pytest.mark.parametrize("line", [
    "trustbatch train objectiv.name=grpo",                       # a config key that does not exist
    "trustbatch train train.lr=fast",                            # a value of the wrong type
    "trustbatch evaluate --model DIR -b gsm8k",                  # a command that does not exist
    "trustbatch eval --model DIR -b gsm8k --max-new-token 64",   # an option that does not exist
    "trustbatch eval --model DIR -b gsm8k -n many",              # an option value of the wrong type
    "trustbatch lab runn clip",                                  # a lab command that does not exist
])
def test_a_broken_example_fails(line):
    with pytest.raises(AssertionError):
        check(*argv_of(line)[:1])
