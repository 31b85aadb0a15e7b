"""The semantic checks of a sweep config (method and task names and hyperparameters, the database URL,
budgets against the protocol), made with the same registries and constructors the runner uses so a
config that passes can run; and where a config's relative paths resolve (the project directory).

A config is checked once, at the edge (``load_checked_config``, the command line, or ``expand`` for a
config built in code): the result is kept on the config while it is unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvleague.db.spec_hash import spec_hash
from kvleague.engine.errors import KvleagueError
from kvleague.runner.sweep_config import SweepConfig, clip, load_config

PROJECT_DIR_ENV = "KVLEAGUE_PROJECT_DIR"


def project_dir() -> Path:
    """Where relative paths in a config (model directories, SQLite files, data_dir) resolve.

    ``$KVLEAGUE_PROJECT_DIR`` if set; inside a Ray job whose working directory was uploaded
    (``ray job submit --working-dir .``), the kvleague checkout the installed package points at
    (an editable install), since the uploaded copy leaves ignored files such as ``artifacts/``
    behind; else the current directory."""
    env = os.environ.get(PROJECT_DIR_ENV)
    if env:
        return Path(env).expanduser().resolve()
    cwd = Path(os.getcwd())
    if "runtime_resources" in cwd.parts or any(part.startswith("_ray_pkg_") for part in cwd.parts):
        checkout = editable_checkout()
        if checkout is not None:
            return checkout
    return cwd


def editable_checkout() -> Path | None:
    """The source directory of an editable ``pip install -e`` of kvleague, if that is how it is installed."""
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    # several may be found (a source tree's *.egg-info when it is on sys.path): the installed one
    # is the one with direct_url.json
    for dist in metadata.distributions(name="kvleague"):
        text = dist.read_text("direct_url.json")
        if not text:
            continue
        try:
            info = json.loads(text)
        except ValueError:
            continue
        url = info.get("url", "")
        if info.get("dir_info", {}).get("editable") and url.startswith("file://"):
            path = Path(unquote(urlparse(url).path))
            if path.is_dir():
                return path
    return None


def resolve_model_source(source: str, base_dir: Path | None = None) -> str:
    """Local paths made absolute (from the project directory); known names and Hub ids unchanged:
    each worker resolves those on its own machine (``runner.models.source``)."""
    from kvleague.runner.models.source import absolute_spec

    return absolute_spec(source, base_dir or project_dir())


def resolve_data_dir(config: SweepConfig, base_dir: Path | None = None) -> str | None:
    if not config.data_dir:
        return None
    path = Path(config.data_dir).expanduser()
    if not path.is_absolute():
        path = (base_dir or project_dir()) / path
    return str(path)


def load_checked_config(path: str | os.PathLike[str], base_dir: Path | None = None) -> SweepConfig:
    """Read, validate and semantically check a sweep YAML file (bad input: one line naming the file)."""
    config = load_config(path)
    try:
        check_config(config, base_dir=base_dir)
    except KvleagueError as exc:
        raise KvleagueError(clip(f"config {Path(path)}: {exc}")) from None
    return config


def check_config(config: SweepConfig, base_dir: Path | None = None) -> list[str]:
    """Semantic checks; returns warnings (skipped optional tasks). Raises KvleagueError. A config
    already checked, unchanged since, against the same project directory is not checked again."""
    base = base_dir or project_dir()
    state = spec_hash(config.model_dump(mode="json"))
    if config._checked is None or config._checked[:2] != (state, str(base)):
        config._checked = (state, str(base), _check(config, base))
    return list(config._checked[2])


def _check(config: SweepConfig, base: Path) -> list[str]:
    from kvleague.db.session import parse_url
    from kvleague.engine.protocol import Protocol
    from kvleague.methods.registry import build_method, method_class
    from kvleague.runner.models.source import check_spec
    from kvleague.tasks.episode import EpisodicTask
    from kvleague.tasks.registry import build_task, task_class

    warnings: list[str] = []
    parse_url(config.database, base)

    for i, model in enumerate(config.models):
        try:
            check_spec(resolve_model_source(model.source, base))
        except KvleagueError as exc:
            raise KvleagueError(f"models[{i}].source: {str(exc).removeprefix('model: ')}") from None
    labels = [m.label for m in config.models]
    if len(set(labels)) != len(labels):
        raise KvleagueError(f"models: duplicate model name in {labels}; give each a distinct name")

    seen_methods: set[str] = set()
    for i, method in enumerate(config.methods):
        try:  # a registered name, or one of a family (kvpress:<Press>)
            method_class(method.name)
        except KvleagueError as exc:
            raise KvleagueError(f"methods[{i}].name: {str(exc).removeprefix('method: ')}") from None
        for point in method.points():
            try:
                built = build_method(method.name, point)
            except KvleagueError as exc:
                raise KvleagueError(f"methods[{i}]: {exc}") from None
            key = method_key(method.name, built.params())
            if key in seen_methods:
                raise KvleagueError(
                    f"methods[{i}]: {method.name} with {json.dumps(built.params(), sort_keys=True)} is listed twice"
                )
            seen_methods.add(key)

    seen_tasks: set[str] = set()
    checked_protocols: set[Protocol] = set()
    n_tasks = 0
    for i, entry in enumerate(config.tasks):
        try:
            cls = task_class(entry.name)
        except KvleagueError as exc:
            if entry.optional:
                warnings.append(f"tasks[{i}]: {entry.name!r} is not registered; skipped (optional)")
                continue
            raise KvleagueError(f"tasks[{i}].name: {str(exc).removeprefix('task: ')}") from None
        try:
            task = build_task(entry.name, entry.options)
        except KvleagueError as exc:
            raise KvleagueError(f"tasks[{i}].options: {exc}") from None
        if entry.measure == "both" and config.fidelity.reference == "self":
            raise KvleagueError(
                f"tasks[{i}].measure: with fidelity.reference self a task is scored against the model's "
                "own trace, a different task from its generation; allowed: generation or fidelity "
                "(two sweeps for both)"
            )
        if (
            entry.measure != "fidelity"
            and issubclass(cls, EpisodicTask)
            and (config.protocol_for(cls.domain, cls.protect_prompt).budget_base != "none")
        ):
            raise KvleagueError(
                f"tasks[{i}].measure: {entry.name} is episodic, so a budget relative to the prompt "
                "(budget_base: prompt) cannot be resolved before it runs; allowed for it: fidelity"
            )
        if entry.measure != "generation" and not cls.has_reference():
            raise KvleagueError(
                f"tasks[{i}].measure: {entry.name} has no reference continuation, so {entry.measure!r} "
                "cannot be measured; allowed for it: generation"
            )
        key = json.dumps([entry.name, task.option_values()], sort_keys=True, default=str)
        if key in seen_tasks:
            raise KvleagueError(f"tasks[{i}]: {entry.name} with the same options is listed twice")
        seen_tasks.add(key)
        n_tasks += 1
        protocol = config.protocol_for(cls.domain, cls.protect_prompt)
        if protocol not in checked_protocols:  # tasks of one domain share a protocol: its budgets checked once
            checked_protocols.add(protocol)
            for budget in config.budgets:
                try:
                    protocol.check_budget(budget)
                except KvleagueError as exc:
                    raise KvleagueError(
                        f"budgets: {str(exc).removeprefix('budget: ')} (protocol for {cls.domain})"
                    ) from None
    if n_tasks == 0:
        raise KvleagueError("tasks: none of the listed tasks is registered")
    # the base protocol must fit the budgets even when every domain overrides it
    fields = config.protocol.model_dump()
    base_protocol = Protocol(**{**fields, "protect_prompt": bool(fields["protect_prompt"])})
    if base_protocol not in checked_protocols:
        for budget in config.budgets:
            base_protocol.check_budget(budget)
    if config.data_dir:
        path = Path(resolve_data_dir(config, base) or "")
        if not path.is_dir():
            raise KvleagueError(f"data_dir: {str(path)!r} is not a directory")
    return warnings


def method_key(name: str, params: dict[str, Any]) -> str:
    return spec_hash({"name": name, "params": params})
