"""Containment of tasks.sandbox: every hostile program is stopped, scored as failed within its
timeout, leaves no process and no file behind, and the test process survives."""

from __future__ import annotations

import os
import secrets
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the sandbox's containment is Linux-specific", allow_module_level=True)

from kvleague.tasks.sandbox import SandboxLimits, run_many, run_python

pytestmark = pytest.mark.usefixtures("code_sandbox")

TIMEOUT = 2.0
LIMITS = SandboxLimits(timeout_s=TIMEOUT)
# the sandbox may take a moment to start and to tear down
SLACK = 6.0


def _processes_with(marker: str, uid: int | None) -> list[int]:
    """Independent scan of /proc: live processes carrying the run's marker or the sandbox uid."""
    needle = f"KVLEAGUE_SANDBOX_ID={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
            if state == b"Z":
                continue
            if uid is not None and os.stat(f"/proc/{entry}").st_uid == uid:
                found.append(int(entry))
                continue
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _assert_contained(result, started: float) -> None:
    assert result.status != "passed", result
    assert time.monotonic() - started < TIMEOUT + SLACK
    assert _processes_with(result.marker, result.isolation.get("sandbox_uid")) == []
    assert result.tempdir and not Path(result.tempdir).exists()


def test_plain_programs_pass_and_fail():
    ok = run_python("print('hello from the sandbox')\nassert sum(range(10)) == 45\n", LIMITS)
    assert ok.status == "passed" and ok.returncode == 0
    assert ok.stdout == "hello from the sandbox\n"
    bad = run_python("assert 1 + 1 == 3, 'arithmetic'\n", LIMITS)
    assert bad.status == "failed" and "AssertionError: arithmetic" in bad.stderr
    syntax = run_python("def f(:\n", LIMITS)
    assert syntax.status == "failed" and "SyntaxError" in syntax.stderr


def test_the_supervisor_is_a_module_run_by_path_and_importing_it_runs_nothing(monkeypatch):
    import subprocess

    import kvleague.tasks.sandbox_supervisor as supervisor
    from kvleague.tasks.sandbox import SUPERVISOR

    assert SUPERVISOR == Path(supervisor.__file__).resolve() and SUPERVISOR.is_file()
    forks = []
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or 0)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: forks.append(2))
    import importlib

    importlib.reload(supervisor)  # module body again: definitions only, no fork, no program
    assert forks == []
    monkeypatch.undo()
    # a failing program's traceback passes through the supervisor's own file, by its path
    bad = run_python("raise ValueError('from the program')\n", LIMITS)
    assert bad.status == "failed" and "ValueError: from the program" in bad.stderr
    assert f'File "{SUPERVISOR}"' in bad.stderr and 'File "main.py", line 1' in bad.stderr


def test_exit_is_failure_and_main_block_does_not_run():
    for code in ("import sys\nsys.exit(0)\n", "exit()\n", "raise SystemExit\n"):
        assert run_python(code, LIMITS).status == "failed", code
    r = run_python("if __name__ == '__main__':\n    raise RuntimeError('demo block ran')\n", LIMITS)
    assert r.status == "passed", r.stderr


def test_isolation_is_recorded():
    r = run_python("import os\nprint(os.getuid())\n", LIMITS)
    iso = r.isolation
    assert r.passed and int(r.stdout) == iso["sandbox_uid"] != 0
    assert iso["unprivileged_user"] and iso["seccomp_unix"] and iso["rlimits"]
    assert set(iso["namespaces"]) == {"net", "pid", "mount", "ipc", "uts"}
    assert iso["cgroup"] in ("v1", "v2") or os.environ.get("KVLEAGUE_SANDBOX_NO_CGROUP") == "1"


def test_infinite_loop_times_out():
    t = time.monotonic()
    r = run_python("while True:\n    pass\n", LIMITS)
    assert r.status == "timeout"
    _assert_contained(r, t)


def test_sleeping_program_times_out():
    t = time.monotonic()
    r = run_python("import time\ntime.sleep(3600)\n", LIMITS)
    assert r.status == "timeout"
    _assert_contained(r, t)


def test_fork_bomb_is_contained():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t = time.monotonic()
    r = run_python(bomb, LIMITS)
    _assert_contained(r, t)


def test_escaped_daemon_is_killed():
    # a grandchild that leaves the session (setsid) and outlives its parent
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(3600)\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
        "raise SystemExit(1)\n"
    )
    t = time.monotonic()
    r = run_python(code, LIMITS)
    _assert_contained(r, t)


def test_huge_allocation_fails():
    t = time.monotonic()
    r = run_python("block = bytearray(20 * 1024 ** 3)\nblock[-1] = 1\n", LIMITS)
    assert r.status == "failed" and "MemoryError" in r.stderr
    _assert_contained(r, t)


def test_writing_outside_the_temp_dir_is_blocked(tmp_path):
    tag = secrets.token_hex(6)
    targets = [
        tmp_path / f"escape-{tag}.txt",
        Path(tempfile.gettempdir()) / f"kvleague-escape-{tag}.txt",
        Path.home() / f"kvleague-escape-{tag}.txt",
        Path(__file__).resolve().parent / f"kvleague-escape-{tag}.txt",
    ]
    code = (
        f"targets = {[str(p) for p in targets]!r}\n"
        "written = []\n"
        "for path in targets:\n"
        "    try:\n"
        "        with open(path, 'w') as fh:\n"
        "            fh.write('escaped')\n"
        "        written.append(path)\n"
        "    except OSError as exc:\n"
        "        print('blocked', path, type(exc).__name__)\n"
        "assert written == targets, written\n"
    )
    t = time.monotonic()
    try:
        r = run_python(code, LIMITS)
        _assert_contained(r, t)
        assert r.stdout.count("blocked") == len(targets)
        assert [p for p in targets if p.exists()] == []
    finally:
        for p in targets:
            p.unlink(missing_ok=True)
    # the working directory itself is writable
    assert run_python("open('out.txt', 'w').write('fine')\nassert open('out.txt').read() == 'fine'\n", LIMITS).passed


def test_killing_the_parent_and_the_test_process_fails():
    code = (
        "import os, signal, time\n"
        f"targets = [os.getppid(), {os.getpid()}]\n"
        "killed = []\n"
        "for pid in targets:\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "        killed.append(pid)\n"
        "    except OSError:\n"
        "        pass\n"
        "time.sleep(0.5)\n"
        "assert killed == targets, killed\n"
    )
    t = time.monotonic()
    r = run_python(code, LIMITS)
    _assert_contained(r, t)
    os.kill(os.getpid(), 0)  # still here


def test_kill_everything_is_contained():
    code = (
        "import os, signal, time\n"
        "parent = os.getppid()\n"
        "os.kill(-1, signal.SIGKILL)\n"
        "time.sleep(0.5)\n"
        "try:\n"
        "    os.kill(parent, 0)\n"
        "    alive = True\n"
        "except PermissionError:\n"
        "    alive = True\n"
        "except ProcessLookupError:\n"
        "    alive = parent == 0\n"
        "assert not alive, 'the parent survived'\n"
    )
    t = time.monotonic()
    r = run_python(code, LIMITS)
    _assert_contained(r, t)
    os.kill(os.getpid(), 0)


def test_network_is_unreachable():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'exfiltrated')\n"
    try:
        t = time.monotonic()
        r = run_python(code, LIMITS)
        _assert_contained(r, t)
        with pytest.raises(socket.timeout):
            server.accept()  # nobody connected
    finally:
        server.close()


def test_environment_secrets_are_not_visible(monkeypatch):
    secret = "kvl-secret-" + secrets.token_hex(12)
    monkeypatch.setenv("KVLEAGUE_TEST_SECRET", secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    code = (
        "import os\n"
        f"needle = {secret[:12]!r} + {secret[12:]!r}\n"
        "found = [k for k, v in os.environ.items() if needle in v]\n"
        "for pid in os.listdir('/proc'):\n"
        "    for part in ('environ', 'cmdline'):\n"
        "        try:\n"
        "            with open(f'/proc/{pid}/{part}', 'rb') as fh:\n"
        "                if needle.encode() in fh.read():\n"
        "                    found.append(pid)\n"
        "        except OSError:\n"
        "            pass\n"
        "print('found' if found else 'nothing')\n"
        "assert found, 'no secret visible'\n"
    )
    t = time.monotonic()
    r = run_python(code, LIMITS)
    _assert_contained(r, t)
    assert r.stdout.strip() == "nothing"
    assert secret not in r.stdout + r.stderr


def test_output_flood_is_capped():
    t = time.monotonic()
    r = run_python(
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", SandboxLimits(timeout_s=TIMEOUT, file_size_mb=1)
    )
    _assert_contained(r, t)
    assert len(r.stdout) <= 8192


def test_run_many_keeps_order():
    programs = ["assert True\n", "assert False\n", "print(7 * 6)\n", "raise ValueError\n"]
    results = run_many(programs, LIMITS, workers=2)
    assert [r.status for r in results] == ["passed", "failed", "passed", "failed"]
    assert results[2].stdout == "42\n"
