"""The sandbox's supervisor: the program :mod:`tasks.sandbox` runs **by path** in a fresh
``python -I -S -B``, as root and PID 1 of new PID, mount, network, IPC and UTS namespaces, one per run.

It reads the run's configuration (JSON, no secret) from ``argv[1]`` and, from stdin, the program
(length-prefixed) and then the run's proof secret. It joins the run's cgroups, builds the program's
file-system view (a fresh tmpfs root holding only the system library trees and the interpreter's
trees, read-only, a private ``/tmp`` with the working directory, a fresh ``/proc``, a minimal
``/dev``) and pivots into it; forks the program's process (new session, rlimits, the unprivileged
uid, a seccomp filter denying ``AF_UNIX`` sockets, Landlock, then :func:`run_program`); reads the
secret only then (so the program's memory, a copy of ours, never holds it); waits under the
wall-clock timeout; and exits with the program's status. What was applied goes to stderr after a
``@@KVLEAGUE_SANDBOX@@`` tag, with ``proof`` = the secret only when the program's code ran to its
end (the child says so on a pipe, after the last statement returned).

Standard library only (plus pyseccomp, loaded by path), and nothing runs on import: the generated
program runs only in the forked child of this script's process.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import os
import platform
import resource
import select
import signal
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
OPT = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048}
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
#: system trees the interpreter's shared libraries live in (links are recreated, directories bound)
SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "full", "random", "urandom")
WORKDIR = "/tmp/work"
AF_UNIX = 1

# exit codes besides the program's own (tasks.sandbox reads them)
EXIT_TIMEOUT = 124
EXIT_SUPERVISOR_ERROR = 125
EXIT_PROGRAM_EXIT = 3  # the program called sys.exit()/exit()
EXIT_PROGRAM_FAILED = 1
INFO_TAG = b"\n@@KVLEAGUE_SANDBOX@@"
DONE = b"done"  # what the child writes once the program's last statement returned


def mount(libc, src, target, fstype, flags, data=None):
    if libc.mount(src, target.encode(), fstype, ctypes.c_ulong(flags), data) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}")


def unescape(p):
    return p.encode().decode("unicode_escape").encode("latin-1").decode()


def join_cgroups(procs_files):
    """Move this process (and so everything it forks) into the run's cgroups."""
    for path in procs_files:
        with open(path, "w") as fh:
            fh.write("0")
    if procs_files:
        with open("/proc/self/cgroup") as fh:
            mine = fh.read()
        for path in procs_files:
            leaf = os.path.basename(os.path.dirname(path))
            if f"/{leaf}\n" not in mine:
                raise OSError(f"not in cgroup {leaf} after joining it")


def bind(libc, src, new_root):
    target = new_root + src
    if os.path.isdir(src):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "wb").close()
    mount(libc, src.encode(), target, None, MS_BIND | MS_REC)


def build_root(cfg, libc, applied):
    """A fresh tmpfs root with only what the interpreter needs, pivoted into; every mount in it
    read-only except the private ``/tmp`` (with the working directory) and ``/dev/shm``."""
    uid = cfg["uid"]
    new = cfg["root"]
    mount(libc, b"tmpfs", new, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755")
    # /tmp first: an interpreter tree under /tmp (a venv in a checkout there) is bound inside it
    os.mkdir(new + "/tmp")
    mount(libc, b"tmpfs", new + "/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['tmpfs_mb']}m,mode=1777".encode())
    os.mkdir(new + WORKDIR, 0o700)
    os.chown(new + WORKDIR, uid, uid)
    for top in SYSTEM_TREES:
        if os.path.islink(top):
            os.symlink(os.readlink(top), new + top)
        elif os.path.isdir(top):
            bind(libc, top, new)
    bound = [t for t in SYSTEM_TREES if os.path.isdir(t) and not os.path.islink(t)]
    for tree in cfg["expose"]:
        if not any(tree == b or tree.startswith(b + "/") for b in bound):
            bind(libc, tree, new)
            bound.append(tree)
    os.mkdir(new + "/proc")
    mount(libc, b"proc", new + "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(new + "/dev")
    mount(libc, b"tmpfs", new + "/dev", b"tmpfs", MS_NOSUID | MS_NOEXEC, b"size=64k,mode=0755")
    for dev in DEVICES:
        bind(libc, "/dev/" + dev, new)
    os.mkdir(new + "/dev/shm")
    mount(
        libc, b"tmpfs", new + "/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['tmpfs_mb']}m,mode=1777".encode()
    )
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "fd/0"), ("stdout", "fd/1"), ("stderr", "fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    os.chdir(new)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(SYS_PIVOT_ROOT[platform.machine()]), b".", b".") != 0:
        raise OSError(ctypes.get_errno(), "pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:  # the old root, stacked under the new one
        raise OSError(ctypes.get_errno(), "umount old root")
    os.chdir("/")
    ro = 0
    with open("/proc/self/mountinfo") as fh:
        points = [(unescape(p[4]), p[5]) for p in (line.split() for line in fh)]
    for point, opts in points:
        if point in ("/tmp", "/dev/shm") or point == "/proc" or point.startswith("/proc/"):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for o in opts.split(","):
            flags |= OPT.get(o, 0)
        mount(libc, None, point, None, flags)
        ro += 1
    applied["readonly_mounts"] = ro


def landlock(libc, writable):
    """Restrict file-system writes to ``writable`` (and TCP, signals, abstract sockets where the ABI
    allows); returns the ABI."""
    SYS_CREATE, SYS_ADD, SYS_RESTRICT = 444, 445, 446
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return 0
    fs = (1 << 1) | (1 << 4) | (1 << 5) | sum(1 << i for i in range(6, 13))
    if abi >= 2:
        fs |= 1 << 13
    if abi >= 3:
        fs |= 1 << 14
    net = 3 if abi >= 4 else 0
    scoped = 3 if abi >= 6 else 0

    class Attr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]

    attr = Attr(fs, net, scoped)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    rs = libc.syscall(SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if rs < 0:
        return 0
    file_rights = (1 << 1) | ((1 << 14) if abi >= 3 else 0)
    for path, rights in [(p, fs) for p in writable] + [("/dev/null", file_rights)]:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneath(rights, fd)
        libc.syscall(SYS_ADD, ctypes.c_int(rs), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0))
        os.close(fd)
    ok = libc.syscall(SYS_RESTRICT, ctypes.c_int(rs), ctypes.c_uint32(0)) == 0
    os.close(rs)
    return abi if ok else 0


def deny_unix_sockets(seccomp):
    """A seccomp filter (libseccomp, which also kills other syscall ABIs): ``socket(AF_UNIX, ...)``
    fails with EPERM, so no path or abstract unix socket can be reached (socketpair still works)."""
    flt = seccomp.SyscallFilter(seccomp.ALLOW)
    flt.add_rule(seccomp.ERRNO(1), "socket", seccomp.Arg(0, seccomp.EQ, AF_UNIX))
    flt.load()  # sets no_new_privs first


def _end(code, _exit=os._exit):
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    _exit(code)


def run_program(done_fd, _write=os.write):
    """Run ``main.py`` of the working directory with ``__name__ == "__sandbox__"``; only reaching its
    end writes :data:`DONE` to ``done_fd`` and exits 0. Never returns."""
    try:
        with open("main.py", encoding="utf-8") as fh:
            src = fh.read()
        code = compile(src, "main.py", "exec")
        exec(code, {"__name__": "__sandbox__", "__file__": "main.py", "__builtins__": vars(builtins)})
    except SystemExit as exc:
        try:
            sys.stderr.write(f"program called exit({exc.code!r})\n")
        finally:
            _end(EXIT_PROGRAM_EXIT)
    except BaseException:
        try:
            import traceback

            traceback.print_exc()
        finally:
            _end(EXIT_PROGRAM_FAILED)
    _write(done_fd, DONE)
    _end(0)


def start_program(cfg, libc, seccomp, program, info_write, done_write):
    """In the forked child: new session, limits, the unprivileged uid, seccomp, Landlock, the program."""
    uid = cfg["uid"]
    os.setsid()
    fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    os.chdir(WORKDIR)
    with open("main.py", "wb") as fh:
        fh.write(program)
    os.chown("main.py", uid, uid)
    cpu = cfg["cpu_s"]
    for what, value in [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (cfg["as_bytes"],) * 2),
        (resource.RLIMIT_FSIZE, (cfg["fsize_bytes"],) * 2),
        (resource.RLIMIT_NOFILE, (cfg["nofile"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_NPROC, (cfg["nproc"],) * 2),
    ]:
        resource.setrlimit(what, value)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError("could not become the sandbox uid")
    deny_unix_sockets(seccomp)
    info = {"landlock_abi": landlock(libc, [WORKDIR, "/dev/shm"]), "uid": os.getuid(), "seccomp_unix": True}
    os.write(info_write, json.dumps(info).encode())
    os.close(info_write)
    sys.argv = ["main.py"]
    sys.path.extend(p for p in cfg["site_paths"] if p not in sys.path)
    run_program(done_write)


def read_exact(fd, n):
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def load_seccomp(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("pyseccomp", path)
    assert spec is not None and spec.loader is not None  # a .py file's spec always has a loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    cfg = json.loads(sys.argv[1])
    size = int.from_bytes(read_exact(0, 8), "big")
    program = read_exact(0, size)
    libc = ctypes.CDLL(None, use_errno=True)
    applied = {}
    try:
        join_cgroups(cfg["cgroup_procs"])
        seccomp = load_seccomp(cfg["seccomp"])  # loads libseccomp while the host's libraries are in view
        build_root(cfg, libc, applied)
    except BaseException as exc:
        os.write(2, (f"sandbox: setup failed: {exc!r}\n").encode())
        os._exit(EXIT_SUPERVISOR_ERROR)

    info_r, info_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(info_r)
            os.close(done_r)
            start_program(cfg, libc, seccomp, program, info_w, done_w)
            os._exit(EXIT_SUPERVISOR_ERROR)
        except BaseException as exc:
            try:
                os.write(2, (f"sandbox: child setup failed: {exc!r}\n").encode())
            finally:
                os._exit(EXIT_SUPERVISOR_ERROR)
    os.close(info_w)
    os.close(done_w)
    secret = read_exact(0, 64).decode()  # only now: the child's memory never held it
    info = b""
    while chunk := os.read(info_r, 4096):
        info += chunk
    os.close(info_r)
    deadline = time.monotonic() + cfg["timeout_s"]
    status = None
    pfd = os.pidfd_open(pid)
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        select.select([pfd], [], [], left)
        got, st = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            status = st
    os.set_blocking(done_r, False)
    try:
        done = os.read(done_r, len(DONE) + 1) == DONE
    except BlockingIOError:
        done = False
    timed_out = status is None
    if timed_out:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        applied.update(json.loads(info))
    except ValueError:
        pass
    if done and status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        applied["proof"] = secret
    os.write(2, INFO_TAG + json.dumps(applied).encode() + b"\n")
    # our exit tears the whole PID namespace down
    if timed_out or status is None:
        os._exit(EXIT_TIMEOUT)
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
