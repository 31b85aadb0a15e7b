"""Run one trusted function on untrusted arguments in a child process under a time and memory limit.

BFCL's simulators are trusted code, but the model picks their arguments: ``square_root(2,
precision=50000000)``, ``power(10, 40000000000)`` or a backtracking ``grep`` pattern would hold the
worker for minutes. :func:`run_limited` hands ``fn(*args)`` (a module-level function and picklable
arguments) to a small helper process started once per worker (:func:`serve`); the helper forks a
child per call (forking the small helper costs milliseconds, forking a worker that holds torch and a
model costs ~100 ms), caps its address space at what it maps plus ``memory_mb`` and its CPU time,
kills it past ``timeout_s`` wall clock, and sends back the pickled return value, the message of
what it raised, or which limit it hit.
"""

from __future__ import annotations

import os
import pickle
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

_PAGE = os.sysconf("SC_PAGE_SIZE")
_lock = threading.Lock()
_server: subprocess.Popen | None = None


class LimitExceeded(Exception):
    """The function ran past its time or memory limit, or its process died."""


class CallFailed(Exception):
    """The function raised; the message is its exception's ``str()`` (BFCL reports that)."""


def _send(out: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj)
    out.write(len(data).to_bytes(8, "big") + data)
    out.flush()


def _recv(inp: IO[bytes]) -> Any:
    head = inp.read(8)
    if len(head) < 8:
        raise EOFError
    return pickle.loads(inp.read(int.from_bytes(head, "big")))


def _child(fn: Callable[..., Any], args: tuple, memory_mb: int, cpu_s: int, write_fd: int) -> None:
    """In the forked child: limits, the call, its outcome on ``write_fd``; never returns."""
    try:
        with open("/proc/self/statm") as fh:
            limit = int(fh.read().split()[0]) * _PAGE + (memory_mb << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        try:
            payload = pickle.dumps(("ok", fn(*args)))
        except MemoryError:
            payload = pickle.dumps(("limit", f"the call exceeded its memory limit ({memory_mb} MB)"))
        except BaseException as exc:  # any failure is the caller's to report, with its message
            try:
                message = str(exc)
            except BaseException:
                message = type(exc).__name__
            payload = pickle.dumps(("raised", message))
        with os.fdopen(write_fd, "wb") as out:
            out.write(payload)
    finally:
        os._exit(0)


def _run_one(fn: Callable[..., Any], args: tuple, timeout_s: float, memory_mb: int) -> tuple[str, Any]:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(fn, args, memory_mb, max(1, int(timeout_s + 0.999)), write_fd)
    os.close(write_fd)
    chunks, deadline, timed_out = [], time.monotonic() + timeout_s, False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_fd], [], [], left)[0]:
                timed_out = True
                break
            chunk = os.read(read_fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
        if timed_out:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if timed_out:
        return "limit", f"the call exceeded its time limit ({timeout_s:g} s)"
    if not chunks:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit status {os.WEXITSTATUS(status)}"
        return "limit", f"the call's process died ({how}; limits {timeout_s:g} s CPU, {memory_mb} MB)"
    return pickle.loads(b"".join(chunks))


def serve() -> None:
    """The helper's loop: one request (fn, args, timeout_s, memory_mb, warm) at a time from stdin,
    each in a forked child, each outcome to stdout; ``warm()`` (trusted imports the children share)
    runs once in the helper itself. Ends when stdin closes (its worker is gone)."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the protocol stream
    warmed: set[Any] = set()
    while True:
        try:
            fn, args, timeout_s, memory_mb, warm = _recv(inp)
        except EOFError:
            return
        if warm is not None and warm not in warmed:
            warmed.add(warm)
            try:
                warm()
            except Exception:  # only a speed-up: the children import what they need themselves
                pass
        _send(out, _run_one(fn, args, timeout_s, memory_mb))


def _helper() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        _server = subprocess.Popen(
            [sys.executable, "-c", "from kvleague.tasks.limited import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a Ctrl-C meant for the worker does not end the helper mid-call
        )
    return _server


def run_limited(
    fn: Callable[..., Any], args: tuple, timeout_s: float, memory_mb: int, warm: Callable[[], Any] | None = None
) -> Any:
    """``fn(*args)`` in a limited child: its (picklable) return value; :class:`CallFailed` with the
    message of what it raised; :class:`LimitExceeded` past ``timeout_s`` seconds or ``memory_mb`` MB.
    ``fn`` and ``warm`` are module-level functions (pickled by name)."""
    with _lock:
        server = _helper()
        assert server.stdin is not None and server.stdout is not None
        try:
            _send(server.stdin, (fn, args, timeout_s, memory_mb, warm))
            kind, value = _recv(server.stdout)
        except (OSError, EOFError):
            server.kill()
            raise LimitExceeded("the limited-call helper process died") from None
    if kind == "limit":
        raise LimitExceeded(value)
    if kind == "raised":
        raise CallFailed(value)
    return value
