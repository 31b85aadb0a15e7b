"""Run untrusted Python (model-written programs plus their tests) in a contained child process.

This module is the only place in kvleague that executes generated code. Each call to
:func:`run_python` runs **one** program in its own process tree: ``unshare`` starts a fresh
``python -I -S -B`` supervisor (:mod:`tasks.sandbox_supervisor`) as root and PID 1 of new PID,
mount, network (a down loopback only), IPC and UTS namespaces, in the run's own cgroup; the
supervisor pivots into a minimal file-system view (system library trees and the interpreter's
trees read-only, a private ``/tmp`` holding the working directory ``/tmp/work``, a fresh ``/proc``,
a few ``/dev`` nodes: no data directory, no database, no home, no socket) and forks the program's
process, which runs under a random unused uid with no capability, rlimits, a seccomp filter denying
``AF_UNIX`` sockets and Landlock (writes only beneath its working directory; TCP, signals and
abstract sockets scoped where the kernel's ABI allows).

**It fails closed**: where any of that cannot be set up (not root, no ``unshare``, no libseccomp,
no cgroup with memory and pids controllers, a probe run that fails) :func:`run_python` raises a
one-line :class:`KvleagueError` naming why and how to fix it; it never runs the program with less.
The one opt-in is ``KVLEAGUE_SANDBOX_NO_CGROUP=1``, for machines without a writable cgroup: memory
and processes are then bounded per process (rlimits) only, not for the whole tree.

Always: a wall-clock timeout, a minimal environment (no inherited variables: no secrets), stdin
from ``/dev/null``, stdout/stderr to size-capped files, and at the end every process of the run is
killed (the PID namespace dies with its PID 1; the cgroup's processes and any process carrying the
run's random marker are killed too) and its directory and cgroup removed.

**Proof**: the program runs with ``__name__ == "__sandbox__"`` and passes only if its last
statement returned (an exception, ``sys.exit()`` or ``os._exit()`` of any code, a signal, a timeout
or the death of the supervisor is a failure): only then does the supervisor report the run's
secret, which the host sent it after forking the program (so the program's memory never held it).
"""

from __future__ import annotations

import ctypes.util
import importlib.util
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
NO_CGROUP_ENV = "KVLEAGUE_SANDBOX_NO_CGROUP"

#: the supervisor, run by path in a fresh interpreter (stdlib only; see its docstring)
SUPERVISOR = Path(__file__).resolve().with_name("sandbox_supervisor.py")
_NS_FLAGS = ["--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child"]


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one run. ``timeout_s`` is wall-clock; CPU time is limited to the same."""

    timeout_s: float = 10.0
    memory_mb: int = 2048  # the whole process tree (cgroup memory.max) and each process (RLIMIT_AS)
    file_size_mb: int = 16  # largest file the program may write, stdout/stderr included
    max_processes: int = 64  # processes/threads of the run (cgroup pids.max and RLIMIT_NPROC)
    max_open_files: int = 256
    tmpfs_mb: int = 128  # size of the private /tmp (and of /dev/shm)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        for name in ("memory_mb", "file_size_mb", "max_processes", "max_open_files", "tmpfs_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class SandboxResult:
    """Outcome of one run. ``status``: ``passed`` (ran to the end and the proof came back),
    ``failed`` (exception, exit or signal), ``timeout`` (wall clock or CPU limit) or ``error`` (the
    sandbox itself failed)."""

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
# cgroups: one per run under a parent where memory and pids can be limited (v2, else v1)


@dataclass(frozen=True)
class _Cgroups:
    version: int
    parents: dict[str, Path]  # controller ("memory", "pids"; "" for v2) -> parent directory


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount root, mount point, fstype, super options) of every mount."""
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            pre, _, post = line.partition(" - ")
            a, b = pre.split(), post.split()
            out.append((a[3], a[4].replace("\\040", " "), b[0], b[2] if len(b) > 2 else ""))
    return out


def _under(mount_root: str, point: str, path: str) -> Path:
    rel = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path.lstrip("/")
    return Path(point) / rel


def _find_cgroups(
    own_cgroups: str | None = None, mounts: list[tuple[str, str, str, str]] | None = None
) -> _Cgroups | None:
    """Where this machine lets the sandbox make a cgroup limiting memory and processes (from
    ``/proc/self/cgroup`` and the mount table unless given)."""
    try:
        if own_cgroups is None:
            with open("/proc/self/cgroup") as fh:
                own_cgroups = fh.read()
        mounts = _mounts() if mounts is None else mounts
    except OSError:
        return None
    lines = [line.split(":", 2) for line in own_cgroups.splitlines() if line.count(":") >= 2]
    own = {ctrl: path for _, ctrls, path in lines for ctrl in (ctrls.split(",") if ctrls else [""])}
    for root, point, fstype, _ in mounts:
        if fstype != "cgroup2" or "" not in own:
            continue
        for parent in (_under(root, point, own[""]), Path(point)):
            try:
                enabled = set((parent / "cgroup.subtree_control").read_text().split())
                if not {"memory", "pids"} <= enabled:
                    (parent / "cgroup.subtree_control").write_text("+memory +pids")
                return _Cgroups(2, {"": parent})
            except OSError:
                continue
    parents = {}
    for root, point, fstype, opts in mounts:
        for ctrl in ("memory", "pids"):
            if fstype == "cgroup" and ctrl in opts.split(",") and ctrl in own and os.access(point, os.W_OK):
                parents[ctrl] = _under(root, point, own[ctrl])
    return _Cgroups(1, parents) if set(parents) == {"memory", "pids"} else None


def _make_cgroups(cg: _Cgroups, marker: str, limits: SandboxLimits) -> list[Path]:
    """The run's cgroup directories, limits written (memory without swap; processes and threads)."""
    mem, pids = limits.memory_mb << 20, limits.max_processes + 2  # + the supervisor and the program's process
    settings = {
        "": [("memory.max", mem), ("memory.swap.max", 0), ("pids.max", pids)],
        "memory": [("memory.limit_in_bytes", mem), ("memory.memsw.limit_in_bytes", mem)],
        "pids": [("pids.max", pids)],
    }
    made = []
    try:
        for ctrl, parent in cg.parents.items():
            d = parent / f"kvleague-sandbox-{marker}"
            d.mkdir()
            made.append(d)
            for name, value in settings[ctrl]:
                if (d / name).exists() or name in ("memory.max", "memory.limit_in_bytes", "pids.max"):
                    (d / name).write_text(str(value))
    except OSError:
        _remove_cgroups(made)
        raise
    return made


def _remove_cgroups(dirs: list[Path]) -> int:
    """Kill what is left in the run's cgroups and remove them; returns how many were killed."""
    killed = 0
    for d in dirs:
        for _ in range(200):
            try:
                pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
            except OSError:
                pids = []
            killed += _sigkill(pids)
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # its processes are still exiting
                time.sleep(0.005)
    return killed


# ------------------------------------------------------------------------------------------------
_probe_lock = threading.Lock()
_probe_result: dict[str, Any] = {}


def _interpreter_paths() -> list[str]:
    """Directory trees the sandboxed interpreter needs to read (real paths)."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    paths.add(os.path.dirname(os.path.realpath(sys.executable)))
    paths.update(os.path.realpath(p) for p in _site_paths())
    return sorted(p for p in paths if p != "/")


def _site_paths() -> list[str]:
    import site

    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def _refusal() -> str | None:
    """Why this machine cannot run generated code contained (None when it can), before any probe run."""
    fix = "(kvleague runs generated code only fully contained; see docs/tasks.md, 'What the sandbox guarantees')"
    if not sys.platform.startswith("linux"):
        return f"the code sandbox needs Linux namespaces; this is {sys.platform} {fix}"
    if os.geteuid() != 0:
        return f"the code sandbox needs root, to run each program as its own unprivileged uid in new namespaces; run as root (e.g. in a container) {fix}"
    if not shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin"):
        return f"the code sandbox needs util-linux's unshare; install it (apt-get install util-linux) {fix}"
    if importlib.util.find_spec("pyseccomp") is None or ctypes.util.find_library("seccomp") is None:
        return f"the code sandbox needs libseccomp and pyseccomp to deny unix sockets; install them (apt-get install libseccomp2; pip install pyseccomp) {fix}"
    data = os.environ.get("KVLEAGUE_DATA_DIR")
    for tree in _interpreter_paths():
        for secret_dir in (data, os.path.expanduser("~")):
            if secret_dir and (os.path.realpath(secret_dir) + "/").startswith(tree + "/"):
                return f"the interpreter tree {tree} would expose {secret_dir} to generated code; use a venv outside it {fix}"
    if _find_cgroups() is None and os.environ.get(NO_CGROUP_ENV) != "1":
        return (
            "no writable cgroup (v2 with memory and pids, or v1 memory and pids) to bound the memory and processes of "
            f"a program's whole process tree; run where /sys/fs/cgroup is writable, or set {NO_CGROUP_ENV}=1 to accept "
            f"per-process limits only {fix}"
        )
    return None


def sandbox_refusal() -> str | None:
    """Why generated code cannot run here (checked once, with one probe run), or None when it can."""
    with _probe_lock:
        if "reason" not in _probe_result:
            reason = _refusal()
            if reason is None:
                probe = _run("pass\n", SandboxLimits(timeout_s=20))
                if probe.status != "passed":
                    last = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
                    reason = f"the code sandbox's probe run failed ({last}); it refuses to run generated code with less containment"
            _probe_result["reason"] = reason
        return _probe_result["reason"]


def _ready() -> None:
    reason = sandbox_refusal()
    if reason is not None:
        raise KvleagueError(f"tasks.sandbox: {reason}")


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
    for entry in os.listdir("/proc"):
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
        killed += _sigkill(pids)
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


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    """Wait for ``proc`` without Popen.wait's polling sleeps."""
    pidfd = os.pidfd_open(proc.pid)
    try:
        select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    try:
        return proc.wait(timeout=0)
    except subprocess.TimeoutExpired:
        return None


def run_python(program: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``program`` (Python source) in the sandbox and report how it ended; raises
    :class:`KvleagueError` (one line) where the sandbox cannot be set up."""
    _ready()
    return _run(program, limits or SandboxLimits())


def _run(program: str, limits: SandboxLimits) -> SandboxResult:
    marker = secrets.token_hex(16)
    proof = secrets.token_hex(32)
    host_dir = Path(tempfile.mkdtemp(prefix="kvleague-sandbox-"))
    (host_dir / "root").mkdir()
    uid = 200_000 + secrets.randbelow(800_000)  # an unused uid, so RLIMIT_NPROC counts only this run
    env = _base_env("/tmp/work")
    env[MARKER_ENV] = marker
    found = _find_cgroups()
    cgroups: list[Path] = []
    spec = importlib.util.find_spec("pyseccomp")
    try:
        if found is not None:
            cgroups = _make_cgroups(found, marker, limits)
        cfg = {
            "uid": uid,
            "root": str(host_dir / "root"),
            "timeout_s": limits.timeout_s,
            "cpu_s": max(1, int(limits.timeout_s + 0.999)),
            "as_bytes": limits.memory_mb << 20,
            "fsize_bytes": limits.file_size_mb << 20,
            "nofile": limits.max_open_files,
            "nproc": limits.max_processes,
            "tmpfs_mb": limits.tmpfs_mb,
            "expose": _interpreter_paths(),
            "site_paths": _site_paths(),
            "cgroup_procs": [str(d / "cgroup.procs") for d in cgroups],
            "seccomp": spec.origin if spec else "",
        }
        unshare = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin") or "unshare"
        cmd = [unshare, *_NS_FLAGS, "--", sys.executable, "-I", "-S", "-B", str(SUPERVISOR), json.dumps(cfg)]
        out_path, err_path = host_dir / "stdout", host_dir / "stderr"
        start = time.monotonic()
        returncode: int | None = None
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=host_dir, env=env, start_new_session=True
            )
            try:
                try:
                    assert proc.stdin is not None
                    data = program.encode("utf-8")
                    proc.stdin.write(len(data).to_bytes(8, "big") + data + proof.encode())
                    proc.stdin.close()
                except OSError:
                    pass
                returncode = _wait(proc, limits.timeout_s + 10)
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                if returncode is None:
                    proc.wait()
        killed = _remove_cgroups(cgroups) + _sweep(marker)
        cgroups = []
        duration = time.monotonic() - start
        stdout, stderr = _tail(out_path), _tail(err_path)
    finally:
        _remove_cgroups(cgroups)
        shutil.rmtree(host_dir, ignore_errors=True)
    info: dict[str, Any] = {}
    tag = INFO_TAG.decode()
    if tag in stderr:
        stderr, _, rest = stderr.rpartition(tag)
        try:
            info = json.loads(rest.strip().splitlines()[0])
        except (ValueError, IndexError):
            info = {}
    isolation = {
        "namespaces": ["net", "pid", "mount", "ipc", "uts"],
        "unprivileged_user": info.get("uid") == uid,
        "sandbox_uid": uid,
        "cgroup": f"v{found.version}" if found else None,
        "seccomp_unix": bool(info.get("seccomp_unix")),
        "landlock_abi": int(info.get("landlock_abi", 0)),
        "rlimits": True,
        "readonly_mounts": int(info.get("readonly_mounts", 0)),
    }
    if returncode is None or returncode in (EXIT_TIMEOUT, 128 + int(signal.SIGXCPU)):
        status = "timeout"
    elif returncode == 0 and secrets.compare_digest(str(info.get("proof", "")), proof):
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
    _ready()  # probe once before the threads start
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: run_python(p, limits), programs))


def _sigkill(pids: list[int]) -> int:
    """SIGKILL each of ``pids``; how many were still there to kill."""
    killed = 0
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
    return killed
