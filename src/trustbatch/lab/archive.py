"""``trustbatch lab archive``: keep what the report reads, drop the checkpoints, pack the runs.

A lab run directory is mostly checkpoints (about 1 GB per session); the report reads only small
files. Archiving those into a folder that can be committed lets ``trustbatch lab report --runs
ARCHIVE`` rebuild the report after the machine that ran the experiments is gone. The per-round traces
are most of what is left (tens of MB for a lab), so each experiment's run files go into one
``runs.tar.xz`` (``lab.records``, which the report and ``lab compare`` read through).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..errors import UserError
from ..records import umask_modes
from . import records
from .bases import write_bases

# What load_runs, experiment_section and the pre-flight table read, relative to OUT/EXPERIMENT/.
EXPERIMENT_FILES = ("experiment.yaml", "preflight.json", "wall_s.txt", "calls.jsonl")
RUN_FILES = ("summary.json", "metrics.jsonl", "ratios.jsonl", "steps.jsonl")


def archive_experiment(exp_dir: Path, dest: Path) -> int:
    """Archive one experiment's report inputs from ``exp_dir`` into ``dest`` (replaced as a whole). Returns bytes written.

    Copied as files: the experiment's ``experiment.yaml``, ``preflight.json``, ``wall_s.txt`` and ``calls.jsonl``;
    written: ``bases.json``, each run's base key and weights' SHA-256 (``lab.bases``).
    Packed into ``dest/runs.tar.xz`` (``records.PACK``) under their relative names: each finished run's
    ``ARM/seedK.yaml`` (the resolved config), ``summary.json``, ``metrics.jsonl``, ``ratios.jsonl`` and
    ``steps.jsonl``. Symlinked arms (an ``onpolicy`` arm linked to a shared reference) are packed as files. Runs
    without a ``summary.json`` (unfinished) are left out. ``exp_dir`` may itself be an archived (packed) folder.

    The archive is built in a temporary sibling folder and renamed over ``dest``, so an interrupted
    archive leaves the previous one whole.

    Raises:
        UserError: ``exp_dir`` is not a lab experiment folder (no ``experiment.yaml`` nor ``preflight.json``).
    """
    exp_dir = Path(exp_dir)
    if not any((exp_dir / f).exists() for f in EXPERIMENT_FILES[:2]):
        raise UserError(f"{exp_dir} has no experiment.yaml or preflight.json; pass the --out of `trustbatch lab run` as --runs")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    written = 0
    try:
        for f in EXPERIMENT_FILES:
            if (exp_dir / f).exists():
                shutil.copyfile(exp_dir / f, tmp / f)
                written += (tmp / f).stat().st_size
        written += write_bases(exp_dir, tmp)
        packed: dict[str, bytes] = {}
        for run in records.finished_runs(exp_dir):
            for src in (run.parent / f"{run.name}.yaml", *(run / f for f in RUN_FILES)):
                if records.exists(src):
                    packed[src.relative_to(exp_dir).as_posix()] = records.read_bytes(src)  # follows symlinks
        if packed:
            written += records.write_pack(tmp / records.PACK, packed)
        umask_modes(tmp)
        old = None
        if dest.exists():
            _inline_links_into(dest)
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old.", dir=dest.parent))
            os.replace(dest, old / dest.name)
        os.replace(tmp, dest)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written


def link_duplicates(out: Path) -> list[str]:
    """Keep each trace (``*.jsonl``) that several experiments of the archive ``out`` hold byte for byte in one pack,
    and a link to it (``records.LINKS``) in the others. Returns the experiments whose pack was rewritten.

    The holder of a trace is the experiment its run was trained in (the run's config names it in ``run_dir``), else
    the first experiment by name. Configs and summaries are never linked: they are small, and they say which runs an
    experiment has. Run again after any experiment of ``out`` is re-archived (``archive_runs`` does).

    Raises:
        UserError: a pack links to a holder that is gone or changed (``records.read_bytes``).
    """
    out = Path(out)
    exps = sorted(p.name for p in out.iterdir() if (p / records.PACK).is_file())
    content = {e: {n: records.read_bytes(out / e / n) for n in records.names(out / e / records.PACK)} for e in exps}
    holders: dict[str, tuple] = {}
    for e in exps:
        for name, data in content[e].items():
            if name.endswith(".jsonl"):
                arm, run = name.split("/")[:2]
                cfg = content[e].get(f"{arm}/{run}.yaml", b"").decode()
                origin = next((Path(line[8:].strip()).parts[-3:-2] for line in cfg.splitlines() if line.startswith("run_dir:")), ())
                key = (origin != (e,), e, name)  # where the run was trained first, then by name
                sha = records.digest(data)
                holders[sha] = min(holders.get(sha, key), key)
    changed = []
    for e in exps:
        files, linked = {}, {}
        for name, data in content[e].items():
            sha = records.digest(data) if name.endswith(".jsonl") else None
            if sha is not None and holders[sha][1:] != (e, name):
                linked[name] = [f"{holders[sha][1]}/{holders[sha][2]}", sha]
            else:
                files[name] = data
        pack = out / e / records.PACK
        if linked != records.links(pack) or set(files) != set(records.packed(pack)) - {records.LINKS}:
            _rewrite(pack, files, linked)
            changed.append(e)
    return changed


def _rewrite(pack: Path, files: dict[str, bytes], linked: dict[str, list[str]]) -> None:
    tmp = pack.with_name(f".{pack.name}.tmp")
    records.write_pack(tmp, files, linked)
    os.replace(tmp, pack)


def _inline_links_into(exp: Path) -> None:
    """Rewrite the sibling packs that link into ``exp`` with the linked bytes themselves, before ``exp`` is
    replaced: an experiment never loses a trace that only ``exp`` held (``link_duplicates`` links it again)."""
    for pack in sorted(exp.parent.glob(f"*/{records.PACK}")):
        linked = records.links(pack)
        into = {n for n, (target, _) in linked.items() if target.startswith(f"{exp.name}/")}
        if into and pack.parent != exp:
            files = {n: d for n, d in records.packed(pack).items() if n != records.LINKS}
            files.update({n: records.read_bytes(pack.parent / n) for n in into})
            _rewrite(pack, files, {n: v for n, v in linked.items() if n not in into})


def archive_runs(runs: Path, out: Path, experiments: list[str] | None = None) -> dict[str, int]:
    """Archive each experiment under ``runs`` (all by default) into ``out/EXPERIMENT``, then link the traces the
    archive's experiments share (``link_duplicates``). Returns {experiment: bytes of its archived folder}.

    Raises:
        UserError: ``runs`` does not exist, or a named experiment is not under it.
    """
    runs, out = Path(runs), Path(out)
    if not runs.is_dir():
        raise UserError(f"--runs {runs} is not a folder; pass the --out of `trustbatch lab run`")
    names = experiments or sorted(p.name for p in runs.iterdir() if (p / "experiment.yaml").exists() or (p / "preflight.json").exists())
    missing = [n for n in names if not (runs / n).is_dir()]
    if missing:
        raise UserError(f"no experiment folder {', '.join(missing)} under {runs}; run `trustbatch lab run` first or fix the name")
    for n in names:
        archive_experiment(runs / n, out / n)
    link_duplicates(out)
    return {n: sum(p.stat().st_size for p in (out / n).rglob("*") if p.is_file()) for n in names}
