"""The Ray cluster of a run (``orchestrator=ray``): join it or start it, and leave nothing of it behind.

- Installed: ``check_ray`` fails before any work, without importing Ray (it takes seconds).
- Reachable: an address (``ray_address``, else ``RAY_ADDRESS``) is first tried with a plain TCP connection for at
  most ``CONNECT_TIMEOUT_S``: ``ray.init`` itself retries an unreachable GCS for minutes without a word (Ray 2.60).
  A port that accepts connections but is not a Ray GCS still waits in ``ray.init``.
- Token: for a local cluster that ``ray.init`` starts, Ray 2.60 turns token authentication on and, unless it is
  given a token, writes a new one to ``~/.ray/auth_token``, where it stays (and becomes the token of every later
  local cluster and ``ray start`` of that user). When the user gives none (no ``RAY_AUTH_MODE``,
  ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), ``connect`` gives this process a random
  token in ``RAY_AUTH_TOKEN`` instead: the cluster's processes inherit it and nothing is written. It is the same
  for every cluster this process starts, since Ray's token loader keeps the first token it reads.
- Shutdown: ``close_actors`` kills the actors and, when this process started the cluster, shuts it down and waits
  until every process of it has ended (after ``ray.shutdown()`` Ray's workers notice on their own, up to about 5 s
  later; those still running after ``LINGER_S`` are killed). Processes are found in ``/proc``; elsewhere, and for a
  cluster that was joined, the actors are killed without waiting.

``ray`` is imported in this package only, inside functions, so trustbatch works without it.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import socket
from pathlib import Path

from ..errors import UserError
from ..processes import kill, process_tree, wait_gone

INSTALL_HINT = "orchestrator=ray needs Ray, which is not installed: pip install 'trustbatch[ray]'"
CONNECT_TIMEOUT_S = 10.0  # a first TCP connection to the cluster's address
LINGER_S = 1.0  # after ray.shutdown(), before the cluster's remaining processes are killed
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
_started: list[int] = []  # the processes ray.init started here (gcs_server, raylet, ...), while Ray runs


def check_ray(address: str | None = None) -> None:
    """Fail before any work when Ray is missing or the cluster's address does not answer (``check_reachable``).

    Raises:
        UserError: Ray is not installed (one line naming the extra); the address is unreachable.
    """
    try:
        found = importlib.util.find_spec("ray") is not None
    except ValueError:  # sys.modules["ray"] is None: an import of ray would fail
        found = False
    if not found:
        raise UserError(INSTALL_HINT)
    check_reachable(address)


def import_ray():
    """The ``ray`` module.

    Raises:
        UserError: Ray is not installed (one line naming the extra).
    """
    try:
        import ray
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    return ray


def check_reachable(address: str | None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Open (and close) a TCP connection to ``address`` (else ``RAY_ADDRESS``; ``host:port`` or ``ray://host:port``)
    within ``timeout_s`` seconds. No address, ``auto`` or ``local``: nothing to try (Ray finds or starts a cluster).

    Raises:
        UserError: the address is not ``host:port``, or nothing answers there in time: one line naming the address,
            where it came from and the fix.
    """
    named = f"ray_address={address}" if address else f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS')}"
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None or address in ("auto", "local"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UserError(f"{named} is not host:port (e.g. 10.0.0.5:6379, the address `ray start --head` prints); "
                        "correct it, or leave ray_address and RAY_ADDRESS unset to start a local cluster")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        why = f"no answer within {timeout_s:g} s" if isinstance(e, socket.timeout) else (e.strerror or repr(e))
        raise UserError(f"cannot reach the Ray cluster at {named} ({why}): start it there "
                        f"(`ray start --head --port={port}`), correct the address, or leave ray_address and "
                        "RAY_ADDRESS unset to start a local cluster") from None


def _starts_local_cluster(ray, address: str | None) -> bool:
    """Whether ``ray.init(address=address)`` would start a new cluster (Ray's own rule: no address, no
    ``RAY_ADDRESS`` and no cluster started on this machine with ``ray start``); False when that cannot be told."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(address) is None
    except Exception:  # another Ray version, or no single answer: leave Ray's own behaviour alone
        return False


def _process_token() -> None:
    """A token in this process's environment for the local cluster ``ray.init`` is about to start, unless the user
    gave one or chose a mode (module docstring)."""
    if any(v in os.environ for v in _AUTH_VARS) or (Path.home() / ".ray" / "auth_token").exists():
        return
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def _children() -> set[int]:
    me = os.getpid()
    return set(process_tree([me])) - {me}


def connect(address: str | None, cpus: int) -> bool:
    """Initialise Ray in this process unless it is already: join ``address`` (or ``RAY_ADDRESS``, or a
    cluster started on this machine with ``ray start``), else start a local cluster. Returns whether this
    call initialised Ray (the caller then ends it with ``close_actors(..., started_ray=True)``).

    A local cluster started here gets ``cpus`` logical CPUs when the machine has fewer cores: Ray places
    an actor only on a free logical CPU, and a run's actors (rollout workers and learner ranks, one CPU
    each) would otherwise wait forever on a small machine; they share its cores instead. A cluster
    that is joined keeps its own CPUs.

    Raises:
        UserError: Ray is not installed; the address does not answer (``check_reachable``).
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    check_reachable(address)
    if _starts_local_cluster(ray, address):
        _process_token()
    # no dashboard: it is a web server (and an extra) a training run does not need
    kw: dict = dict(address=address, include_dashboard=False)
    if cpus > (os.cpu_count() or 1):
        kw["num_cpus"] = cpus
    before = _children()
    try:
        ray.init(**kw)
    except ValueError:  # "When connecting to an existing cluster, num_cpus ... must not be provided"
        if "num_cpus" not in kw:
            raise
        del kw["num_cpus"]
        ray.init(**kw)
    # only ray.init starts processes under this one meanwhile: the cluster's own (none when joining one)
    _started[:] = sorted(_children() - before)
    return True


def close_actors(ray, actors: list, started_ray: bool) -> None:
    """Kill ``actors`` (``None`` entries are skipped; an actor already dead is fine) and, with ``started_ray``,
    shut down the cluster ``connect`` started and wait until its processes (actors included) have ended."""
    for actor in actors:
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead, or Ray already down
                pass
    if not started_ray or not ray.is_initialized():
        return
    tree = process_tree(_started) if _started else []
    _started.clear()
    ray.shutdown()
    left = wait_gone(tree, LINGER_S)
    kill(left)
    wait_gone(left, 5.0)
