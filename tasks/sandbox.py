"""Run untrusted Python (model-written programs plus their tests) in a contained child process.

This module is the only place in kvleague that executes generated code. Each call to
:func:`run_python` runs **one** program in its own process tree (a fresh ``python -I -S -B``
supervisor and the program's process forked from it) under layered containment; each layer that
the OS allows is applied and recorded in :attr:`SandboxResult.isolation`:

``namespaces``  (Linux, root or unprivileged user namespaces; checked once with ``unshare``)
    new network namespace (only a down loopback: no network at all), new PID namespace (the
    supervisor is PID 1: when it exits the kernel kills every process left in the namespace), new
    mount namespace in which every mount is remounted read-only and private ``tmpfs`` mounts
    replace ``/tmp`` and ``/dev/shm`` (the working directory is ``/tmp/work`` there; it vanishes
    with the namespace), new IPC and UTS namespaces, a fresh ``/proc``. Directories the sandbox user
    cannot traverse (e.g. ``/root`` when the interpreter lives there) are hidden behind an empty
    tmpfs with only the interpreter's trees bound back read-only.
``unprivileged_user``
    when started as root the program runs under a random unused uid/gid (so RLIMIT_NPROC applies and
    nothing outside the working directory is writable or signalable).
``landlock``  (Linux >= 5.13)
    file-system writes are allowed only beneath the working directory (and ``/dev/null``); with
    Landlock ABI >= 4 TCP bind/connect are denied; with ABI >= 6 signals to processes outside the
    sandbox and abstract unix sockets are denied.
``rlimits``
    CPU seconds, address space, file size, number of processes, open files, no core dumps.

Always: a wall-clock timeout, a fresh temporary directory, a minimal environment (no inherited
variables: no secrets), stdin from ``/dev/null``, stdout/stderr to size-capped files, a new session,
and at the end every process of the run is killed: the supervisor kills its process tree, the host
kills the session and then sweeps ``/proc`` for any process carrying the run's random marker in its
environment (this catches processes that escaped with ``setsid``), and the directory is removed.

The supervisor is :mod:`tasks.sandbox_supervisor`, run by path in a fresh ``python -I -S -B``; the
program runs in a child forked from it after the limits are applied (site-packages are put on
``sys.path`` without running ``.pth`` hooks). The program runs with ``__name__ == "__sandbox__"`` (``if __name__ == "__main__":`` demo blocks in a
completion do not run), and passes only if it runs to its end: an exception, ``sys.exit()`` of any
code, a signal or a timeout is a failure. ``KVLEAGUE_SANDBOX_MODE=plain`` disables the namespace
layer (for debugging); ``namespaces`` makes its absence an error.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvleague.engine.errors import KvleagueError
from kvleague.tasks.sandbox_supervisor import EXIT_SUPERVISOR_ERROR, EXIT_TIMEOUT, INFO_TAG

MARKER_ENV = "KVLEAGUE_SANDBOX_ID"
MODE_ENV = "KVLEAGUE_SANDBOX_MODE"

#: the supervisor, run by path in a fresh interpreter (stdlib only; see its docstring)
SUPERVISOR = Path(__file__).resolve().with_name("sandbox_supervisor.py")


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one run. ``timeout_s`` is wall-clock; CPU time is limited to the same."""

    timeout_s: float = 10.0
    memory_mb: int = 2048  # address space (RLIMIT_AS)
    file_size_mb: int = 16  # largest file the program may write, stdout/stderr included
    max_processes: int = 64  # processes/threads of the sandbox user (RLIMIT_NPROC)
    max_open_files: int = 256
    tmpfs_mb: int = 128  # size of the private /tmp in namespace mode

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        for name in ("memory_mb", "file_size_mb", "max_processes", "max_open_files", "tmpfs_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class SandboxResult:
    """Outcome of one run. ``status``: ``passed`` (ran to the end), ``failed`` (exception, exit or
    signal), ``timeout`` (wall clock or CPU limit) or ``error`` (the sandbox itself failed)."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    isolation: dict[str, Any] = field(default_factory=dict)
    leftover_killed: int = 0
    marker: str = ""  # value of $KVLEAGUE_SANDBOX_ID in every process of the run
    tempdir: str = ""  # the host-side temporary directory (removed before returning)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------
_NS_FLAGS = ["--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]
_probe_lock = threading.Lock()
_probe_result: list[str] | None = None


def _namespace_prefix() -> list[str]:
    """The ``unshare`` command prefix that works here ([] when namespaces are unavailable)."""
    global _probe_result
    with _probe_lock:
        if _probe_result is not None:
            return _probe_result
        mode = os.environ.get(MODE_ENV, "auto")
        if mode not in ("auto", "plain", "namespaces"):
            raise KvleagueError(f"{MODE_ENV}: {mode!r} is not one of auto, plain, namespaces")
        prefix: list[str] = []
        exe = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
        if mode != "plain" and sys.platform.startswith("linux") and exe:
            candidates = [[exe, *_NS_FLAGS]] if os.geteuid() == 0 else []
            candidates.append([exe, "--map-root-user", *_NS_FLAGS])
            for cand in candidates:
                try:
                    probe = _run("pass\n", SandboxLimits(timeout_s=20), cand)
                except (OSError, subprocess.SubprocessError):
                    continue
                if probe.status == "passed":
                    prefix = cand
                    break
        if mode == "namespaces" and not prefix:
            raise KvleagueError(
                f"{MODE_ENV}=namespaces but 'unshare' namespaces are not available here; use auto or plain"
            )
        _probe_result = prefix
        return prefix


def _base_env(home: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": home,
        "TMPDIR": home,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
    }


def find_marked_processes(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries ``marker`` (Linux ``/proc``)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def _sweep(marker: str) -> int:
    killed = 0
    for _ in range(100):
        pids = [p for p in find_marked_processes(marker) if p != os.getpid()]
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.01)
    return killed


def _tail(path: Path, limit: int = 8192) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            data = fh.read()
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


def _rmtree(path: Path) -> None:
    def onerror(func: Any, p: str, exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)


def _site_paths() -> list[str]:
    import site

    try:
        return [p for p in site.getsitepackages() if os.path.isdir(p)]
    except AttributeError:  # pragma: no cover - old virtualenv
        return []


def _interpreter_paths() -> list[str]:
    """Directory trees the sandboxed interpreter needs to read."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    paths.add(os.path.dirname(os.path.realpath(sys.executable)))
    return sorted(p for p in paths if p != "/")


def _others_can_use_interpreter() -> bool:
    """Whether a uid other than ours can traverse to the interpreter (needed to drop privileges
    without a mount namespace)."""
    for path in _interpreter_paths() + [os.path.dirname(os.path.abspath(sys.executable))]:
        acc = ""
        for part in path.strip("/").split("/"):
            acc += "/" + part
            try:
                if not os.stat(acc).st_mode & 0o001:
                    return False
            except OSError:
                return False
    return True


def _user_process_count() -> int:
    uid = os.getuid()
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                pass
    return n


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    """Wait for ``proc`` without Popen.wait's polling sleeps (pidfd when available)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            select.select([pidfd], [], [], timeout)
        finally:
            os.close(pidfd)
    try:
        return proc.wait(timeout=0 if pidfd is not None else timeout)
    except subprocess.TimeoutExpired:
        return None


def run_python(program: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``program`` (Python source) in the sandbox and report how it ended."""
    return _run(program, limits or SandboxLimits(), _namespace_prefix())


def _run(program: str, limits: SandboxLimits, prefix: list[str]) -> SandboxResult:
    marker = secrets.token_hex(16)
    host_dir = Path(tempfile.mkdtemp(prefix="kvleague-sandbox-"))
    os.chmod(host_dir, 0o711)
    workdir = host_dir / "work"
    workdir.mkdir()
    as_root = os.geteuid() == 0
    use_ns = bool(prefix)
    userns = use_ns and "--map-root-user" in prefix
    uid = None
    if as_root and not userns and (use_ns or _others_can_use_interpreter()):
        uid = 200_000 + secrets.randbelow(800_000)  # an unused uid, so RLIMIT_NPROC counts only this run
    nproc = limits.max_processes
    if uid is None and not userns and sys.platform.startswith("linux"):
        nproc += _user_process_count()  # RLIMIT_NPROC counts all of this user's processes
    child_home = "/tmp/work" if use_ns else str(workdir)
    env = _base_env(child_home)
    env[MARKER_ENV] = marker
    cfg = {
        "namespaces": use_ns,
        "uid": uid,
        "workdir": str(workdir),
        "timeout_s": limits.timeout_s,
        "cpu_s": max(1, int(limits.timeout_s + 0.999)),
        "as_bytes": limits.memory_mb << 20,
        "fsize_bytes": limits.file_size_mb << 20,
        "nofile": limits.max_open_files,
        "nproc": nproc,
        "tmpfs_mb": limits.tmpfs_mb,
        "env": env,
        "expose": _interpreter_paths(),
        "site_paths": _site_paths(),
    }
    supervisor = [sys.executable, "-I", "-S", "-B", str(SUPERVISOR), json.dumps(cfg)]
    cmd = [*prefix, "--", *supervisor] if prefix else supervisor
    out_path, err_path = host_dir / "stdout", host_dir / "stderr"
    start = time.monotonic()
    returncode: int | None = None
    host_timeout = False
    try:
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=host_dir,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
            try:
                try:
                    assert proc.stdin is not None
                    proc.stdin.write(program.encode("utf-8"))
                    proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
                returncode = _wait(proc, limits.timeout_s + 10)
                host_timeout = returncode is None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                if returncode is None:
                    proc.wait()
        killed = _sweep(marker)
        duration = time.monotonic() - start
        stdout = _tail(out_path)
        stderr = _tail(err_path)
    finally:
        _rmtree(host_dir)
    info: dict[str, Any] = {}
    tag = INFO_TAG.decode()
    if tag in stderr:
        stderr, _, rest = stderr.rpartition(tag)
        try:
            info = json.loads(rest.strip().splitlines()[0])
        except (ValueError, IndexError):
            info = {}
    isolation = {
        "network_namespace": use_ns,
        "pid_namespace": use_ns,
        "private_tmp": use_ns,
        "user_namespace": userns,
        "unprivileged_user": uid is not None and info.get("uid") == uid,
        "landlock_abi": int(info.get("landlock_abi", 0)),
        "rlimits": True,
        "sandbox_uid": uid,
        "readonly_mounts": int(info.get("readonly_mounts", 0)),
        "hidden_dirs": list(info.get("hidden", [])),
    }
    if host_timeout or returncode in (EXIT_TIMEOUT, 128 + int(signal.SIGXCPU)):
        status = "timeout"
    elif returncode == 0 and info:
        status = "passed"
    elif returncode == EXIT_SUPERVISOR_ERROR:
        status = "error"
    else:
        status = "failed"
    return SandboxResult(
        status=status,
        returncode=returncode,
        stdout=stdout,
        stderr=stderr.rstrip("\n"),
        duration_s=duration,
        isolation=isolation,
        leftover_killed=killed,
        marker=marker,
        tempdir=str(host_dir),
    )


def run_many(
    programs: Sequence[str], limits: SandboxLimits | None = None, workers: int | None = None
) -> list[SandboxResult]:
    """:func:`run_python` over ``programs`` with a small pool (each run is its own process tree)."""
    if workers is None:
        workers = max(1, min(4, os.cpu_count() or 1))
    if workers == 1 or len(programs) <= 1:
        return [run_python(p, limits) for p in programs]
    _namespace_prefix()  # probe once before the threads start
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: run_python(p, limits), programs))


def isolation_available() -> dict[str, Any]:
    """What this machine allows (probes namespaces; runs nothing else)."""
    prefix = _namespace_prefix()
    return {"namespaces": bool(prefix), "user_namespace": "--map-root-user" in prefix, "root": os.geteuid() == 0}
