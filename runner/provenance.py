"""Where a number came from: library versions, hardware, host and the code's git commit.

``collect_environment()`` is cheap and runs on the sweep driver and once in every worker (the GPU a
result was produced on is a worker fact, not a driver fact). ``git_state(path)`` is the commit of
the checkout ``path`` lies in, or ``"unknown"`` outside git (or in a repository without commits).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from kvleague.db.spec_hash import spec_hash

GIT_COMMIT_ENV = "KVLEAGUE_GIT_COMMIT"
GIT_DIRTY_ENV = "KVLEAGUE_GIT_DIRTY"  # "1" / "0", with GIT_COMMIT_ENV
UNKNOWN = "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _imported_version(module: str) -> str:
    """The version of ``module`` as this process has it: the loaded module's own, else the installed
    distribution's (a sweep's driver records its environment without importing transformers, ~1.5 s)."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        return loaded.__version__
    found = _version(module)
    if found == "not installed":  # importable without distribution metadata (a bare source tree)
        found = importlib.import_module(module).__version__
    return found


def git_state(path: str | os.PathLike[str] | None = None) -> tuple[str, bool | None]:
    """``(commit, dirty)`` of the git checkout containing ``path``; ``("unknown", None)`` outside git.

    ``$KVLEAGUE_GIT_COMMIT`` (and ``$KVLEAGUE_GIT_DIRTY``) override: the sweep driver hands its
    checkout's state to workers that run an uploaded copy of it without ``.git``."""
    override = os.environ.get(GIT_COMMIT_ENV)
    if override:
        flag = os.environ.get(GIT_DIRTY_ENV)
        return override.strip(), (None if flag not in ("0", "1") else flag == "1")
    where = Path(path or os.getcwd())
    if where.is_file():
        where = where.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--verify", "-q", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if commit.returncode != 0 or not commit.stdout.strip():
            return UNKNOWN, None
        status = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
        return commit.stdout.strip(), dirty
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN, None


def code_dir() -> Path:
    """The directory the running kvleague code was imported from (the repository root)."""
    return Path(__file__).resolve().parent.parent


def resolved_git_state(*fallbacks: str | os.PathLike[str] | None) -> tuple[str, bool | None]:
    """``git_state`` of the running code, else of each fallback directory in turn."""
    state = git_state(code_dir())
    for path in fallbacks:
        if state[0] != UNKNOWN or path is None:
            break
        state = git_state(path)
    return state


def collect_environment(
    git_path: str | os.PathLike[str] | None = None, git: tuple[str, bool | None] | None = None
) -> dict:
    """Provenance of this process. Every value is a real reading; ``"none"`` means absent (no GPU).

    ``git``: an already-resolved ``(commit, dirty)``; else the state of ``git_path`` (default: the code)."""
    import torch

    cuda_available = torch.cuda.is_available()
    gpu_count = torch.cuda.device_count() if cuda_available else 0
    gpu_name = torch.cuda.get_device_name(0) if gpu_count else "none"
    commit, dirty = git if git is not None else git_state(git_path or code_dir())
    try:  # read from metadata: importing ray here would freeze its auth/network settings too early
        ray_version = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        ray_version = "not installed"
    env = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python_version": sys.version.split()[0],
        "torch_version": torch.__version__,
        "transformers_version": _imported_version("transformers"),
        "cuda_version": torch.version.cuda or "none",
        "gpu_name": gpu_name,
        "gpu_count": gpu_count,
        "kvleague_version": _version("kvleague"),
        "ray_version": ray_version,
        "git_commit": commit,
        "git_dirty": dirty,
    }
    env["spec_hash"] = environment_hash(env)
    return env


def environment_hash(env: dict) -> str:
    body = {k: v for k, v in env.items() if k != "spec_hash"}
    return spec_hash(body, spaced=True)
