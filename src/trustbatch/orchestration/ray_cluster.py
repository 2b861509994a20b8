"""The Ray cluster of a run (``orchestrator=ray``): join it or start it, and leave nothing of it behind.

- Installed: ``check_ray`` fails before any work, without importing Ray (it takes seconds).
- Reachable: an address (``ray_address``, else ``RAY_ADDRESS``) is first tried with a TCP connection and an HTTP/2
  greeting, both within ``CONNECT_TIMEOUT_S``: ``ray.init`` itself retries an unreachable GCS for minutes without a
  word, and waits as long on a port that answers but is not a GCS (an HTTP server, the dashboard), with its own log
  lines (Ray 2.60). A GCS is a gRPC server, and answers the HTTP/2 client preface with its SETTINGS frame
  (RFC 9113 section 3.4); with ``RAY_USE_TLS`` it expects a TLS handshake first, and only the connection is tried.
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
- A killed driver: Ray's gcs_server and raylet die with the process that started them (Ray sets the parent-death
  signal on them), but the raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) outlive it by a
  minute or more (they retry reporting to the dead GCS). A local cluster is therefore started under a
  ``processes.Reaper``: a process of its own session that records the cluster's processes while the driver lives
  and kills those still running once the driver is gone, SIGKILL included (within about a second).

``ray`` is imported in this package only, inside functions, so trustbatch works without it.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import socket
import time
from pathlib import Path

from ..errors import UserError
from ..processes import Reaper, kill, process_tree, wait_gone

INSTALL_HINT = "orchestrator=ray needs Ray, which is not installed: pip install 'trustbatch[ray]'"
CONNECT_TIMEOUT_S = 10.0  # a first TCP connection to the cluster's address
LINGER_S = 1.0  # after ray.shutdown(), before the cluster's remaining processes are killed
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
_started: list[int] = []  # the processes ray.init started here (gcs_server, raylet, ...), while Ray runs
_reaper: list[Reaper] = []  # the reaper of the local cluster started here, while Ray runs
# the client connection preface and an empty SETTINGS frame (RFC 9113 sections 3.4 and 6.5)
_H2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


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
    """Connect to ``address`` (else ``RAY_ADDRESS``; ``host:port`` or ``ray://host:port``) and check that it speaks
    HTTP/2, as a Ray GCS (and the Ray Client server) does, all within ``timeout_s`` seconds (module docstring). No
    address, ``auto`` or ``local``: nothing to try (Ray finds or starts a cluster).

    Raises:
        UserError: the address is not ``host:port``, nothing answers there in time, or what answers is not Ray:
            one line naming the address, where it came from and the fix.
    """
    named = f"ray_address={address}" if address else f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS')}"
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None or address in ("auto", "local"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UserError(f"{named} is not host:port (e.g. 10.0.0.5:6379, the address `ray start --head` prints); "
                        "correct it, or leave ray_address and RAY_ADDRESS unset to start a local cluster")
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as conn:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return  # a TLS GCS waits for a TLS handshake: the connection is all that is tried
            answer, hung_up = _greet(conn, deadline)
    except OSError as e:
        why = f"no answer within {timeout_s:g} s" if isinstance(e, socket.timeout) else (e.strerror or repr(e))
        raise UserError(f"cannot reach the Ray cluster at {named} ({why}): start it there "
                        f"(`ray start --head --port={port}`), correct the address, or leave ray_address and "
                        "RAY_ADDRESS unset to start a local cluster") from None
    if len(answer) == 9 and answer[3] == 4 and answer[5:] == bytes(4):  # a SETTINGS frame on stream 0
        return
    if answer[:5] == b"HTTP/" or answer.lstrip()[:1] == b"<":
        what = "an HTTP server answered, not Ray's gRPC"
    elif answer:
        what = f"it answered {answer!r}, not the HTTP/2 of Ray's gRPC"
    else:
        what = "it hung up on a gRPC greeting" if hung_up else f"no answer to a gRPC greeting within {timeout_s:g} s"
    raise UserError(f"{named} answers but is not a Ray cluster ({what}): give the address `ray start --head` "
                    "printed there (the GCS port, 6379 by default, not the dashboard's 8265), or leave ray_address "
                    "and RAY_ADDRESS unset to start a local cluster")


def _greet(conn: socket.socket, deadline: float) -> tuple[bytes, bool]:
    """Send the HTTP/2 client greeting on ``conn``; return the first 9 bytes of the answer (an HTTP/2 server's
    SETTINGS frame header), fewer when the peer hangs up or ``deadline`` (``time.monotonic``) passes first, and
    whether it hung up."""
    answer = b""
    try:
        conn.sendall(_H2_GREETING)
        while len(answer) < 9:
            conn.settimeout(max(deadline - time.monotonic(), 1e-3))
            chunk = conn.recv(9 - len(answer))
            if not chunk:
                return answer, True
            answer += chunk
    except socket.timeout:
        return answer, False
    except OSError:  # reset, or a broken pipe
        return answer, True
    return answer, False


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

    A local cluster started here gets ``cpus`` logical CPUs when the machine (or its container's CPU quota, which
    Ray would count) has fewer: Ray places
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
    local = _starts_local_cluster(ray, address)
    if local:
        _process_token()
    # no dashboard: it is a web server (and an extra) a training run does not need
    kw: dict = dict(address=address, include_dashboard=False)
    if local:  # Ray itself counts a container's CPU quota (cgroups), which may be fewer than the cores
        kw["num_cpus"] = max(cpus, os.cpu_count() or 1)
    elif cpus > (os.cpu_count() or 1):
        kw["num_cpus"] = cpus
    reaper = Reaper() if local and os.path.isdir("/proc") else None
    before = _children()
    try:
        _init(ray, kw)
    except BaseException:
        if reaper is not None:
            reaper.close(kill=True)
        raise
    # only ray.init starts processes under this one meanwhile: the cluster's own (none when joining one)
    _started[:] = sorted(_children() - before)
    if reaper is not None:
        reaper.guard(_started)
        _reaper[:] = [reaper]
    return True


def _init(ray, kw: dict) -> None:
    try:
        ray.init(**kw)
    except ValueError:  # "When connecting to an existing cluster, num_cpus ... must not be provided"
        if "num_cpus" not in kw:
            raise
        del kw["num_cpus"]
        ray.init(**kw)


def close_actors(ray, actors: list, started_ray: bool) -> None:
    """Kill ``actors`` (``None`` entries are skipped; an actor already dead is fine) and, with ``started_ray``,
    shut down the cluster ``connect`` started and wait until its processes (actors included) have ended."""
    for actor in actors:
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead, or Ray already down
                pass
    if not started_ray:
        return
    if ray.is_initialized():
        tree = process_tree(_started) if _started else []
        _started.clear()
        ray.shutdown()
        left = wait_gone(tree, LINGER_S)
        kill(left)
        wait_gone(left, 5.0)
    while _reaper:  # the cluster is gone: nothing for it to kill
        _reaper.pop().close()
