"""The one loader path for task data: the local copy under the data directory when it is there,
otherwise the Hugging Face Hub through ``datasets`` (imported lazily, so offline runs never need it).

Data directory: the ``data_dir`` argument (``--data-dir``), else ``$KVLEAGUE_DATA_DIR``, else none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvleague.engine.errors import KvleagueError

DATA_DIR_ENV = "KVLEAGUE_DATA_DIR"
#: seconds the Hub has to accept a connection (name lookup included) before it counts as unreachable
HUB_PROBE_SECONDS = 3.0


@dataclass(frozen=True)
class DataSource:
    """Where a task's data comes from.

    ``local_path`` is relative to the data directory (a file or a folder); ``hub_id``/``revision``
    (+ ``hub_config``, ``hub_split``) are what :func:`datasets.load_dataset` gets when the data
    directory does not have the local copy. For Hub repositories that only hold raw files (L-Eval,
    LongBench: their loading scripts no longer run under ``datasets>=4``) ``hub_file`` names the file
    inside the repository (``"data.zip!data/qasper.jsonl"`` for a member of an archive); it is
    downloaded with ``huggingface_hub`` and read like a local copy. ``hub_id`` is ``None`` for data
    that is not on the Hub (then ``url`` says where to get it).
    """

    dataset: str
    hub_id: str | None
    revision: str | None
    local_path: str | None
    license: str
    hub_config: str | None = None
    hub_split: str = "test"
    hub_file: str | None = None
    url: str | None = None

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The explicit directory, else ``$KVLEAGUE_DATA_DIR``, else ``None`` (the Hub)."""
    value = data_dir if data_dir not in (None, "") else os.environ.get(DATA_DIR_ENV) or None
    if value is None:
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise KvleagueError(f"data_dir: {str(path)!r} is not a directory (set --data-dir or {DATA_DIR_ENV})")
    return path


def missing_dataset_error(source: DataSource, data_dir: Path | None, why: str) -> KvleagueError:
    """The one-line error for data that is neither in the data dir nor loadable from the Hub."""
    if data_dir is not None and source.local_path:
        expected = str(data_dir / source.local_path)
    else:
        expected = f"<data-dir>/{source.local_path} (set --data-dir or {DATA_DIR_ENV})"
    if source.hub_id is None:
        return KvleagueError(
            f"dataset {source.dataset}: no local copy at {expected}; it is not on the Hugging Face Hub, "
            f"get it from {source.url}"
        )
    hub = f"{source.hub_id}@{source.revision}" if source.revision else source.hub_id
    return KvleagueError(f"dataset {source.dataset}: no local copy at {expected} and Hub id {hub} failed ({why})")


def iter_file(path: Path, member: str | None = None) -> Iterator[dict[str, Any]]:
    """Records of a JSON Lines file (optionally ``.gz``, or ``member`` of a zip archive) or of a JSON
    file holding a list."""
    if member is not None:
        import zipfile

        with zipfile.ZipFile(path) as zf:
            text = zf.read(member).decode("utf-8")
    else:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as fh:
            text = fh.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        yield from json.loads(stripped)
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            raise KvleagueError(f"data file {path}: line {lineno} is not JSON ({exc.msg})") from None


def local_path(source: DataSource, data_dir: Path | None, relative: str | None = None) -> Path | None:
    """The local file/folder for ``source`` (or ``relative`` inside the data dir) if it exists."""
    rel = relative if relative is not None else source.local_path
    if data_dir is None or rel is None:
        return None
    path = data_dir / rel
    return path if path.exists() else None


def load_records(source: DataSource, data_dir: Path | None, *, local: str | None = None) -> list[dict[str, Any]]:
    """Rows of ``source``: the local file ``local`` (default ``source.local_path``) under
    ``data_dir`` when present, else ``datasets.load_dataset(hub_id, hub_config, split, revision)``."""
    rel = local if local is not None else source.local_path
    path = local_path(source, data_dir, rel)
    if path is not None:
        if path.is_dir():
            raise missing_dataset_error(source, data_dir, f"{path} is a directory, expected a file")
        return list(iter_file(path))
    if source.hub_id is None:
        raise missing_dataset_error(source, data_dir, "no local copy")
    return _load_from_hub(source, data_dir)


def hub_reachable(endpoint: str, seconds: float = HUB_PROBE_SECONDS) -> bool:
    """Whether ``endpoint`` accepts a TCP connection within ``seconds``. The lookup and connection run in
    a thread so that a resolver that hangs is bounded too."""
    from urllib.parse import urlsplit

    parts = urlsplit(endpoint)
    address = (parts.hostname or "", parts.port or (80 if parts.scheme == "http" else 443))
    answer: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection(address, timeout=seconds).close()
            answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(seconds)
    return bool(answer and answer[0])


@contextlib.contextmanager
def hub_offline():
    """``HF_HUB_OFFLINE`` for the calls inside: the libraries read the variable once, at import, so the
    flags they keep are switched (a copy in the Hub cache loads; nothing is requested or retried)."""
    from huggingface_hub import constants

    modules: list[Any] = [constants] + [m for m in (sys.modules.get("datasets.config"),) if m is not None]
    saved = [m.HF_HUB_OFFLINE for m in modules]
    for m in modules:
        m.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for m, value in zip(modules, saved):
            m.HF_HUB_OFFLINE = value


def _load_from_hub(source: DataSource, data_dir: Path | None) -> list[dict[str, Any]]:
    # Offline mode is not short-circuited: a copy already in the Hub cache still loads. A Hub that does
    # not answer is treated as offline mode, rather than five retries with backoff (~25 s) per request.
    from huggingface_hub import constants, hf_hub_download

    hub_id = source.hub_id
    assert hub_id is not None  # the caller has no local copy and checked that there is a Hub id
    if source.hub_file is None:
        try:
            import datasets
        except ImportError:
            raise missing_dataset_error(
                source, data_dir, "no local copy and the 'datasets' package is not installed"
            ) from None
    unreachable = not constants.HF_HUB_OFFLINE and not hub_reachable(constants.ENDPOINT)
    filename, _, member = (source.hub_file or "").partition("!")
    try:
        with hub_offline() if unreachable else contextlib.nullcontext():
            if source.hub_file is not None:
                path = hf_hub_download(hub_id, filename, repo_type="dataset", revision=source.revision)
            else:
                ds = datasets.load_dataset(hub_id, source.hub_config, split=source.hub_split, revision=source.revision)
    except Exception as exc:  # network errors, missing configs, offline mode...
        if unreachable:
            why = f"the Hub at {constants.ENDPOINT} is unreachable and the Hub cache has no copy"
        else:
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            what = "download" if source.hub_file is not None else "load"
            why = f"Hub {what} failed: {type(exc).__name__}: {msg[:200]}"
        raise missing_dataset_error(source, data_dir, why) from None
    if source.hub_file is not None:
        return list(iter_file(Path(path), member or None))
    return [dict(row) for row in ds]
