"""The lab's run records, read in one place whether they lie in files or packed in ``runs.tar.xz``.

A ``trustbatch lab run`` folder keeps each run's records as files: ``EXPERIMENT/ARM/seedK.yaml`` (the resolved
config) and ``EXPERIMENT/ARM/seedK/{summary.json, metrics.jsonl, ratios.jsonl, steps.jsonl}``. ``trustbatch lab
archive`` packs all of one experiment's run files into ``EXPERIMENT/runs.tar.xz`` (xz compresses the per-round
traces about sevenfold; one file per experiment keeps a committed archive small, issue 38 item 5), with the same
relative names as members. ``lab report`` and ``lab compare`` read through this module, so a path such as
``ARCHIVE/clip/p3o@mb4/seed0/metrics.jsonl`` reads the same whether it is a file or a member of
``ARCHIVE/clip/runs.tar.xz``. A file on disk wins over a packed member of the same name.

A trace that another experiment of the same archive holds byte for byte (an on-policy reference linked into
several experiments) is packed once: the other packs hold a link to it (``LINKS``, with the bytes' SHA-256, so a
holder re-archived with other runs is an error, not a silent change of the linking experiment's records).
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import lzma
import tarfile
from functools import lru_cache
from pathlib import Path

from ..config import read_yaml_file, yaml_loads
from ..errors import UserError
from ..records import parse_records

PACK = "runs.tar.xz"
# A pack's member {name: [the holder's path relative to the archive folder (EXPERIMENT/ARM/seedK/FILE), sha256 hex]}
LINKS = "links.json"
# xz's strongest preset: packing is done once per archive, reading (decompression) costs the same at any preset
PRESET = 9 | lzma.PRESET_EXTREME


def _pack_member(path: Path) -> tuple[Path, str] | None:
    """(pack, member name) when ``path`` lies inside a folder holding ``PACK`` (up to 3 levels up: ARM/seedK/FILE)."""
    for exp_dir in list(path.parents)[:3]:
        if (exp_dir / PACK).is_file():
            return exp_dir / PACK, path.relative_to(exp_dir).as_posix()
    return None


@lru_cache(maxsize=16)
def _unpacked(pack: str, mtime_ns: int, size: int) -> dict[str, bytes]:
    # Keyed on mtime and size too, so a pack rewritten in place is read again. The report reads every experiment
    # three times (base fingerprints, its section, its cost), so a lab's packs (tens of MB unpacked) stay cached.
    # One lzma.decompress of the whole file: tarfile's streaming "r:xz" reads in small blocks, several times slower.
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(Path(pack).read_bytes()))) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def packed(pack: Path) -> dict[str, bytes]:
    """{member name: bytes} of a pack (cached while the file is unchanged).

    Raises:
        tarfile.TarError, lzma.LZMAError: the file is not an xz-compressed tar.
    """
    st = Path(pack).stat()
    return _unpacked(str(pack), st.st_mtime_ns, st.st_size)


def links(pack: Path) -> dict[str, list[str]]:
    """The pack's ``LINKS`` ({member name: [holder path relative to the archive folder, sha256 hex]}), {} without."""
    raw = packed(pack).get(LINKS)
    return json.loads(raw) if raw else {}


def names(pack: Path) -> set[str]:
    """Every run file name a pack holds, as bytes or as a link."""
    return (set(packed(pack)) - {LINKS}) | set(links(pack))


def digest(data: bytes) -> str:
    """SHA-256 of ``data`` as hex: what a link records of the bytes it stands for."""
    return hashlib.sha256(data).hexdigest()


def _find(path: Path) -> bytes | None:
    """The bytes ``path`` names (a file, a packed member, or a member's link followed), None when it names nothing.

    Raises:
        UserError: a link's holder is missing or no longer holds the linked bytes.
    """
    if path.is_file():
        return path.read_bytes()
    found = _pack_member(path)
    if found is None:
        return None
    pack, name = found
    if name in (members := packed(pack)):
        return members[name]
    if name not in (linked := links(pack)):
        return None
    target, sha = linked[name]
    data = _find(pack.parent.parent / target)
    if data is None or digest(data) != sha:
        raise UserError(f"{path} is packed as a link to {target}, which {'is missing' if data is None else 'holds other bytes now'}"
                        f"; archive {pack.parent.name} again (`trustbatch lab archive {pack.parent.name}`) from its runs")
    return data


def exists(path: Path) -> bool:
    """Whether ``path`` is a file, or a member (or link) of the pack of the experiment folder it lies in.
    Raises UserError as ``read_bytes``."""
    return _find(Path(path)) is not None


def read_bytes(path: Path) -> bytes:
    """The bytes of the file ``path``, else of the packed member it names (a link followed to its holder).

    Raises:
        FileNotFoundError: neither exists.
        UserError: the member is a link whose holder is gone or holds other bytes (names the experiment to re-archive).
    """
    data = _find(Path(path))
    if data is None:
        raise FileNotFoundError(f"{path}: no such file, nor a member of a {PACK} above it")
    return data


def read_text(path: Path) -> str:
    """``read_bytes`` decoded as UTF-8. Raises FileNotFoundError as ``read_bytes``."""
    return read_bytes(path).decode("utf-8")


def read_jsonl(path: Path) -> list[dict]:
    """The JSON records of a JSONL file or member, skipping lines that do not parse (a torn last write).
    Raises FileNotFoundError as ``read_bytes``."""
    return list(parse_records(io.StringIO(read_text(path))))


def read_yaml(path: Path):
    """A resolved config (``ARM/seedK.yaml``) parsed as configs are (``config.yaml_loads``).

    Raises:
        UserError: a file that is not valid YAML (``config.read_yaml_file``); FileNotFoundError as ``read_bytes``.
    """
    return read_yaml_file(path) if Path(path).is_file() else yaml_loads(read_text(path))


def finished_runs(exp_dir: Path, arm: str | None = None) -> list[Path]:
    """The run folders ``EXPERIMENT/ARM/seedK`` that hold a ``summary.json`` (finished), on disk or packed, for one
    ``arm`` or every arm, in the order of ``sorted(exp_dir.glob("*/seed*/summary.json"))``."""
    exp_dir = Path(exp_dir)
    found = set((exp_dir / arm).glob("seed*/summary.json") if arm else exp_dir.glob("*/seed*/summary.json"))
    if (exp_dir / PACK).is_file():
        for name in names(exp_dir / PACK):
            parts = name.split("/")
            if (len(parts) == 3 and parts[2] == "summary.json" and fnmatch.fnmatchcase(parts[1], "seed*")
                    and (arm is None or parts[0] == arm)):
                found.add(exp_dir / name)
    return [p.parent for p in sorted(found)]


def arm_names(exp_dir: Path) -> list[str]:
    """The arm folders of an experiment, on disk or packed, sorted."""
    exp_dir = Path(exp_dir)
    arms = {p.name for p in exp_dir.iterdir() if p.is_dir()}
    if (exp_dir / PACK).is_file():
        arms |= {n.split("/")[0] for n in names(exp_dir / PACK) if "/" in n}
    return sorted(arms)


def write_pack(dest: Path, files: dict[str, bytes], linked: dict[str, list[str]] | None = None) -> int:
    """Write ``files`` ({member name: bytes}) and ``linked`` (as ``LINKS``) as the xz-compressed tar ``dest``;
    returns its size in bytes.

    Members are in name order with zeroed times and owners, so the same records always give the same bytes: a
    re-archived experiment whose runs did not change adds nothing to git history.
    """
    if linked:
        files = {**files, LINKS: (json.dumps(linked, indent=0, sort_keys=True) + "\n").encode()}
    with tarfile.open(dest, "w:xz", preset=PRESET, format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    return Path(dest).stat().st_size
