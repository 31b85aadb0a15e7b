"""The hostile-input corpus (tests/hostile/): every attack on the sandbox, the code scorer and BFCL's
tools that got through before (issue 45) fails now, and the honest control beside it still passes."""

from __future__ import annotations

import gzip
import json
import os
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from kvleague.engine.errors import KvleagueError
from kvleague.tasks.limited import CallFailed, LimitExceeded, run_limited
from tests.conftest import DATA_DIR

HOSTILE = Path(__file__).resolve().parent / "hostile"
REPO = Path(__file__).resolve().parents[1]
CHILD_MB, CAP_MB = 64, 128  # 5 children of 64 MB: each fits the cap, together they do not


@pytest.fixture(scope="module")
def host_secrets():
    """What a program must not reach: a 0600 file in a 0700 directory, a path socket outside /tmp
    and an abstract socket, both listening."""
    base = Path(tempfile.mkdtemp(dir="/var/tmp" if os.access("/var/tmp", os.W_OK) else None))
    secret_dir = base / "private"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "secret.txt"
    secret.write_text("kvleague-host-secret\n")
    secret.chmod(0o600)
    heard: list[bytes] = []
    servers = []
    abstract = f"kvleague-test-{os.getpid()}"
    for address in (str(base / "db.sock"), "\0" + abstract):
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(address)
        srv.listen(4)
        if not address.startswith("\0"):
            os.chmod(address, 0o777)  # as the PostgreSQL socket was
        servers.append(srv)

        def listen(s=srv):
            try:
                conn, _ = s.accept()
                heard.append(conn.recv(100))
            except OSError:
                pass

        threading.Thread(target=listen, daemon=True).start()
    values = {
        "SECRET_FILE": str(secret),
        "HOME_DIR": os.path.expanduser("~"),
        "DATA_DIR": str(DATA_DIR),
        "SOCKET_PATH": str(base / "db.sock"),
        "ABSTRACT_NAME": abstract,
        "CHILD_MB": str(CHILD_MB),
    }
    yield values, heard
    for s in servers:
        s.close()
    secret.unlink()
    secret_dir.rmdir()
    (base / "db.sock").unlink()
    base.rmdir()


def _fill(path: Path, values: dict[str, str]) -> str:
    return string.Template(path.read_text()).safe_substitute(values)


@pytest.mark.parametrize("name", sorted(p.name for p in HOSTILE.glob("program_*.py")))
def test_hostile_program_fails(name, host_secrets, code_sandbox):
    from kvleague.tasks import sandbox

    values, heard = host_secrets
    limits = sandbox.SandboxLimits(timeout_s=5, memory_mb=CAP_MB)
    r = sandbox.run_python(_fill(HOSTILE / name, values), limits)
    assert r.status in ("failed", "timeout"), (r.status, r.stdout, r.stderr[-500:])
    assert "kvleague-host-secret" not in r.stdout + r.stderr
    assert "HumanEval/0" not in r.stdout
    assert heard == []
    if "socket" in name:  # the seccomp filter refuses the socket itself, whatever the view holds
        assert "PermissionError: [Errno 1]" in r.stderr
    if "memory" in name:  # killed by the run's cgroup, not refused by a per-process limit; one child alone fits
        assert "MemoryError" not in r.stderr
        assert sandbox.run_python(f"block = b'x' * ({CHILD_MB} << 20)\n", limits).passed


@pytest.fixture(scope="module")
def humaneval_2():
    from kvleague.tasks.registry import build_task

    task = build_task("humaneval")
    return task, next(s for s in task.load(data_dir=DATA_DIR) if s.sample_id == "HumanEval/2")


@pytest.mark.parametrize("name", sorted(p.name for p in HOSTILE.glob("humaneval_*.py")))
def test_hostile_completion_scores_zero(name, humaneval_2, host_secrets, code_sandbox):
    task, sample = humaneval_2
    values, _ = host_secrets
    honest = "def truncate_number(number: float) -> float:\n    return number % 1.0\n"
    hostile, control = task.score_many([(sample, _fill(HOSTILE / name, values)), (sample, honest)])
    assert control.correct, control.details["stderr"]
    assert not hostile.correct, hostile.details


def test_plain_answers_keep_honest_types(humaneval_2):
    """The answer filter turns subclasses into their built-in value, filters a generator's items and
    refuses Python classes, while numpy's own scalars, Counter and namedtuples compare as before."""
    from kvleague.tasks.code import PLAIN_SOURCE

    scope: dict = {}
    exec(PLAIN_SOURCE.format(name="plain"), scope)
    plain = scope["plain"]

    class Forged(float):
        def __eq__(self, other):
            return True

    from collections import Counter, namedtuple

    import numpy as np

    assert type(plain(Forged(2.0))) is float and plain(Forged(2.0)) != 3.0
    assert plain(Counter("aab")) == {"a": 2, "b": 1} and type(plain(Counter("aab"))) is dict
    assert plain(namedtuple("P", "x y")(1, [2.5])) == (1, [2.5])
    assert plain(np.float64(0.5)) == 0.5 and type(plain(np.int64(3))) is int
    assert plain({1: (Forged(1.0), {True})}) == {1: (1.0, {True})}
    assert list(plain(Forged(x) for x in (1.0, 2.0))) == [1.0, 2.0] and plain(range(3)) == range(3)
    with pytest.raises(TypeError, match="not a built-in value"):
        plain(type("Anything", (), {"__eq__": lambda self, other: True})())
    with pytest.raises(TypeError, match="not a built-in value"):
        plain(np.array([Forged(1.0)], dtype=object))


def test_sandbox_in_a_venv_under_tmp(code_sandbox):
    """The layout CI has (its clone, venv inside, under /tmp): a package of the venv under /tmp is
    importable inside (its tree is bound into the program's private /tmp), nothing beside it is
    visible, and the program runs as the sandbox uid."""
    venv = Path(tempfile.mkdtemp(prefix="kvleague-venv-", dir="/tmp")) / "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        (venv.parent / "beside-the-venv.txt").write_text("kvleague-host-secret\n")
        site_dir = next(venv.glob("lib/python3*/site-packages"))
        (site_dir / "kvleague_tmp_venv_probe.py").write_text("WHERE = __file__\n")
        program = (
            "import os, kvleague_tmp_venv_probe as probe\n"
            "print(probe.WHERE, os.getuid())\n"
            f"assert not os.path.exists({str(venv.parent / 'beside-the-venv.txt')!r})\n"
        )
        probe = (
            "import json, sys\n"
            "from kvleague.tasks.sandbox import run_python\n"
            f"r = run_python({program!r})\n"
            "print(json.dumps([r.status, r.stdout, r.stderr, r.isolation['sandbox_uid']]))\n"
        )
        site = [p for p in sys.path if p.endswith("site-packages")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *site]))
        out = subprocess.run(
            [str(venv / "bin" / "python"), "-c", probe], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr[-2000:]
        status, stdout, stderr, uid = json.loads(out.stdout.splitlines()[-1])
        assert status == "passed", stderr
        assert stdout.split() == [str(site_dir / "kvleague_tmp_venv_probe.py"), str(uid)]
    finally:
        subprocess.run(["rm", "-rf", str(venv.parent)], check=False)


# -- BFCL's tools -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def math_env():
    pytest.importorskip("bfcl_eval")
    from kvleague.tasks.registry import build_task

    task = build_task("bfcl_multi_turn")
    sample = next(s for s in task.load(data_dir=DATA_DIR) if "MathAPI" in s.reference["involved_classes"])
    return task, sample


@pytest.mark.parametrize(
    "name,arguments,message",
    [
        ("square_root", {"number": 2, "precision": 50_000_000}, "precision must be at most 4300 digits"),
        ("power", {"base": 10, "exponent": 40_000_000_000}, "Exceeds the limit (4300 digits)"),
        ("power", {"base": 7, "exponent": 3_000_000}, "Exceeds the limit (4300 digits)"),
        # within the bounds, but the result cannot be printed: the ValueError is the message
        ("multiply", {"a": 10**2200, "b": 10**2200}, "Exceeds the limit (4300 digits)"),
        ("add", {"a": 1, "b": 2, "c": 3}, "Error during execution: MathAPI.add() got an unexpected keyword"),
    ],
)
def test_bfcl_tool_errors_are_messages(math_env, name, arguments, message):
    from kvleague.tasks.tool_calls import ToolCall

    task, sample = math_env
    env = task.make_environment(sample)
    t = time.monotonic()
    out = env.execute(ToolCall(name, arguments))
    assert time.monotonic() - t < 30  # the cell timeout (an hour) no longer bounds it
    assert message in out
    assert env.execute(ToolCall("power", {"base": 7, "exponent": 3})) == '{"result": 343}'  # still serving


def test_bfcl_refused_call_is_an_error_in_the_checker_too(math_env):
    from kvleague.tasks.bfcl import _UNKNOWN_TOOL, bfcl_call_string
    from kvleague.tasks.tool_calls import ToolCall

    known = {"power", "square_root"}
    assert bfcl_call_string(ToolCall("power", {"base": 10, "exponent": 40_000_000_000}), known) == _UNKNOWN_TOOL
    assert bfcl_call_string(ToolCall("power", {"base": 10, "exponent": 40}), known) == "power(base=10, exponent=40)"


def test_limited_call_time_memory_and_exceptions():
    t = time.monotonic()
    with pytest.raises(LimitExceeded, match="time limit"):
        run_limited(time.sleep, (60,), 0.5, 64)
    assert time.monotonic() - t < 10
    with pytest.raises(LimitExceeded, match="memory limit"):
        run_limited(bytearray, (1 << 30,), 5, 64)
    with pytest.raises(CallFailed, match="invalid literal"):
        run_limited(int, ("x",), 5, 64)
    assert run_limited(gzip.decompress, (gzip.compress(b"ok"),), 5, 64) == b"ok"


def test_cgroup_v2_and_v1_layouts_are_found_and_limited(tmp_path):
    """On a stand-in file tree: v2 is taken where its subtree has memory and pids, v1 where both
    controllers are mounted; a run's cgroup gets the tree's limits, and is removed afterwards."""
    from kvleague.tasks.sandbox import SandboxLimits, _find_cgroups, _make_cgroups, _remove_cgroups

    v2 = tmp_path / "unified"
    v2.mkdir()
    (v2 / "cgroup.subtree_control").write_text("cpu memory pids\n")
    found = _find_cgroups("0::/\n", [("/", str(v2), "cgroup2", "rw")])
    assert found is not None and found.version == 2 and found.parents == {"": v2}
    (made,) = _make_cgroups(found, "m1", SandboxLimits(memory_mb=512, max_processes=10))
    assert (made / "memory.max").read_text() == str(512 << 20) and (made / "pids.max").read_text() == "12"
    for f in made.iterdir():
        f.unlink()
    assert _remove_cgroups([made]) == 0 and not made.exists()

    v1 = {c: tmp_path / c for c in ("memory", "pids", "cpu")}
    for d in v1.values():
        d.mkdir()
    own = "4:memory:/\n8:pids:/\n1:cpu:/\n"
    mounts = [("/", str(d), "cgroup", f"rw,{c}") for c, d in v1.items()]
    found = _find_cgroups(own, mounts)
    assert found is not None and found.version == 1 and set(found.parents) == {"memory", "pids"}
    assert _find_cgroups(own, mounts[1:]) is None  # no memory controller: no cgroup (the sandbox refuses)


def test_the_sandbox_refuses_in_one_line_rather_than_run_with_less(monkeypatch):
    """Not root, or no cgroup (unless explicitly accepted): a one-line refusal naming why and the fix."""
    from kvleague.tasks import sandbox

    if not sys.platform.startswith("linux"):
        pytest.skip("the code sandbox is Linux-only")
    monkeypatch.setattr(sandbox, "_find_cgroups", lambda *a: None)
    monkeypatch.delenv(sandbox.NO_CGROUP_ENV, raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    reason = sandbox._refusal()
    assert reason is not None and "no writable cgroup" in reason and f"{sandbox.NO_CGROUP_ENV}=1" in reason
    assert "\n" not in reason
    monkeypatch.setenv(sandbox.NO_CGROUP_ENV, "1")
    assert sandbox._refusal() is None or "cgroup" not in sandbox._refusal()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in sandbox._refusal()
    monkeypatch.setattr(sandbox, "_probe_result", {})
    with pytest.raises(KvleagueError, match=r"^tasks\.sandbox: the code sandbox needs root"):
        sandbox.run_python("print('never runs')\n")
