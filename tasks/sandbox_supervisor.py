"""The sandbox's supervisor: the program :mod:`tasks.sandbox` runs **by path** in a fresh
``python -I -S -B`` (PID 1 of the new PID namespace in namespace mode), one per run.

It reads the run's configuration (JSON) from ``argv[1]`` and the program from stdin, prepares the
working directory (read-only remounts, private ``/tmp``, hidden untraversable directories), forks
the program's process (new session, rlimits, uid drop, Landlock, then :func:`run_program`), waits
for it under the wall-clock timeout, kills whatever is left and exits with the status; the limits
actually applied go to stderr after a ``@@KVLEAGUE_SANDBOX@@`` tag.

Standard library only, and nothing runs on import: the generated program runs only in the forked
child of this script's process, never in a process that imports this module.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = (
    1,
    2,
    4,
    8,
    32,
    1024,
    2048,
    4096,
)
MS_MOVE, MS_REC, MS_RELATIME, MS_STRICTATIME = 8192, 16384, 1 << 21, 1 << 24
OPT = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}

# exit codes besides the program's own (tasks.sandbox reads them)
EXIT_TIMEOUT = 124
EXIT_SUPERVISOR_ERROR = 125
EXIT_PROGRAM_EXIT = 3  # the program called sys.exit()/exit()
EXIT_PROGRAM_FAILED = 1
INFO_TAG = b"\n@@KVLEAGUE_SANDBOX@@"


def mount(libc, src, target, fstype, flags, data):
    r = libc.mount(src, target.encode(), fstype, ctypes.c_ulong(flags), data)
    if r != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}")


def unescape(p):
    return p.encode().decode("unicode_escape").encode("latin-1").decode()


def setup(cfg, libc, program, applied):
    """Prepare the file system and the working directory; returns (workdir, writable paths)."""
    uid = cfg["uid"]
    if cfg["namespaces"]:
        points = []
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                parts = line.split()
                points.append((unescape(parts[4]), parts[5]))
        ro = 0
        for point, opts in points:
            if point == "/proc" or point.startswith(("/proc/", "/sys", "/dev")) and point != "/dev/shm":
                continue
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY
            for o in opts.split(","):
                flags |= OPT.get(o, 0)
            if libc.mount(None, point.encode(), None, ctypes.c_ulong(flags), None) == 0:
                ro += 1
        applied["readonly_mounts"] = ro
        owner = f"uid={uid},gid={uid}," if uid is not None else ""
        for point in ("/tmp", "/dev/shm"):
            if os.path.isdir(point) and not os.path.islink(point):
                mount(
                    libc,
                    b"tmpfs",
                    point,
                    b"tmpfs",
                    MS_NOSUID | MS_NODEV,
                    f"size={cfg['tmpfs_mb']}m,mode=0700,{owner}".encode(),
                )
        if uid is not None:
            # Directories the sandbox user may not traverse (e.g. /root holding the interpreter) are
            # hidden behind an empty tmpfs, and only the interpreter's own trees are bound back, read-only.
            hidden = {}
            for path in cfg["expose"]:
                acc = ""
                for part in path.strip("/").split("/"):
                    acc += "/" + part
                    if not os.stat(acc).st_mode & 0o001:
                        hidden.setdefault(acc, []).append(path)
                        break
            stage_no = 0
            for top, paths in sorted(hidden.items()):
                staged = []
                for path in sorted(set(paths)):
                    stage = f"/tmp/.kvleague-stage-{stage_no}"
                    stage_no += 1
                    os.mkdir(stage)
                    mount(libc, path.encode(), stage, None, MS_BIND | MS_REC, None)
                    staged.append((stage, path))
                mount(libc, b"tmpfs", top, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755")
                for stage, path in staged:
                    os.makedirs(path, mode=0o755, exist_ok=True)
                    mount(libc, stage.encode(), path, None, MS_MOVE, None)
                    os.rmdir(stage)
                    libc.mount(None, path.encode(), None, ctypes.c_ulong(MS_REMOUNT | MS_BIND | MS_RDONLY), None)
                libc.mount(
                    None, top.encode(), None, ctypes.c_ulong(MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV), None
                )
            applied["hidden"] = sorted(hidden)
        workdir = "/tmp/work"
        os.mkdir(workdir, 0o700)
        if uid is not None:
            os.chown(workdir, uid, uid)
        writable = [workdir]
    else:
        workdir = cfg["workdir"]
        writable = [workdir]
        if uid is not None:
            os.chown(workdir, uid, uid)
    main_py = os.path.join(workdir, "main.py")
    with open(main_py, "wb") as fh:
        fh.write(program)
    if uid is not None:
        os.chown(main_py, uid, uid)
    return workdir, writable


def landlock(libc, writable):
    """Restrict file-system writes to ``writable`` (and TCP, signals where the ABI allows); returns the ABI."""
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
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        rule = PathBeneath(rights, fd)
        libc.syscall(SYS_ADD, ctypes.c_int(rs), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0))
        os.close(fd)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    ok = libc.syscall(SYS_RESTRICT, ctypes.c_int(rs), ctypes.c_uint32(0)) == 0
    os.close(rs)
    return abi if ok else 0


def _end(code):
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code)


def run_program():
    """Run ``main.py`` of the working directory with ``__name__ == "__sandbox__"``; only reaching its
    end is success (exit 0). Never returns."""
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
    _end(0)


def start_program(cfg, libc, workdir, writable, applied, info_write):
    """In the forked child: new session, limits, uid drop, Landlock, then the program."""
    uid = cfg["uid"]
    os.setsid()
    fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.chdir(workdir)
    cpu = cfg["cpu_s"]
    lim = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (cfg["as_bytes"],) * 2),
        (resource.RLIMIT_FSIZE, (cfg["fsize_bytes"],) * 2),
        (resource.RLIMIT_NOFILE, (cfg["nofile"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_NPROC, (cfg["nproc"],) * 2),
    ]
    for what, value in lim:
        resource.setrlimit(what, value)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    info = dict(applied, landlock_abi=landlock(libc, writable), uid=os.getuid())
    os.write(info_write, json.dumps(info).encode())
    os.close(info_write)
    # The program runs in this forked child of the fresh ``python -I -S -B`` supervisor (an exec of
    # yet another interpreter would double the start-up cost of every sample).
    sys.argv = ["main.py"]
    sys.path.extend(p for p in cfg["site_paths"] if p not in sys.path)
    run_program()


def kill_all(pid):
    """Kill the program's process group and every child of ours, reaping them, until none is left."""
    for _ in range(50):
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        kids = set()
        for t in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{t}/children") as fh:
                    kids.update(int(x) for x in fh.read().split())
            except OSError:
                pass
        for k in kids:
            try:
                os.kill(k, signal.SIGKILL)
            except OSError:
                pass
        while True:
            try:
                got, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if got == 0:
                break
        time.sleep(0.002)


def main():
    cfg = json.loads(sys.argv[1])
    program = sys.stdin.buffer.read()
    libc = ctypes.CDLL(None, use_errno=True)
    applied = {}
    try:
        workdir, writable = setup(cfg, libc, program, applied)
    except BaseException as exc:
        os.write(2, (f"sandbox: setup failed: {exc!r}\n").encode())
        os._exit(EXIT_SUPERVISOR_ERROR)

    if not cfg["namespaces"]:
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back to us

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            start_program(cfg, libc, workdir, writable, applied, w)
            os._exit(EXIT_SUPERVISOR_ERROR)
        except BaseException as exc:
            try:
                os.write(2, (f"sandbox: child setup failed: {exc!r}\n").encode())
            finally:
                os._exit(EXIT_SUPERVISOR_ERROR)
    os.close(w)
    info = b""
    while True:
        chunk = os.read(r, 4096)
        if not chunk:
            break
        info += chunk
    os.close(r)
    deadline = time.monotonic() + cfg["timeout_s"]
    status = None
    try:
        pfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pfd = None
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if pfd is not None:
            select.select([pfd], [], [], left)
        else:
            time.sleep(min(left, 0.01))
        got, st = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            status = st

    timed_out = status is None
    if not cfg["namespaces"]:
        kill_all(pid)  # in namespace mode our exit tears the whole PID namespace down
    elif timed_out:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    os.write(2, INFO_TAG + info + b"\n")
    if timed_out:
        os._exit(EXIT_TIMEOUT)
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
