"""Task registry: ``@register_task`` for in-tree tasks, the ``kvleague.tasks`` entry-point group for
third-party packages, name families resolved on demand (``lmeval:gsm8k``) and validated
construction from plain dicts (CLI, sweep configs).

Public API::

    register_task(name)                  class decorator for a Task dataclass
    register_task_family(prefix, resolve) names "prefix:rest" resolve to resolve(rest) -> Task class
    available_tasks() -> dict[str, type[Task]]   every registered task, sorted by name
    task_class(name) -> type[Task]       one-line KvleagueError listing valid names if unknown
    build_task(name, options=None) -> Task       options validated by field name and type
    describe_task(cls) -> dict           JSON-ready description (name, domain, size, source, options)
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from importlib.metadata import entry_points
from typing import Any, Callable, TypeVar

from pydantic import TypeAdapter, ValidationError

from runner.engine.errors import KvleagueError
from tasks.base import DOMAINS, Task

ENTRY_POINT_GROUP = "kvleague.tasks"
_BUILTIN_MODULES = ("tasks.math", "tasks.code", "tasks.longqa", "tasks.agentic", "tasks.bfcl", "tasks.lmeval")

_REGISTRY: dict[str, type[Task]] = {}
_FAMILIES: dict[str, Callable[[str], type[Task]]] = {}
_loaded = False

T = TypeVar("T", bound=type[Task])


def register_task(name: str) -> Callable[[T], T]:
    """Class decorator: register a ``Task`` dataclass under ``name``."""

    def decorate(cls: T) -> T:
        _check_task_class(cls, name)
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise KvleagueError(f"task name {name!r} is registered twice ({existing.__module__} and {cls.__module__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def register_task_family(prefix: str, resolve: Callable[[str], type[Task]]) -> None:
    """Names ``"{prefix}:{rest}"`` resolve to ``resolve(rest)`` (a Task class, or a KvleagueError)."""
    _FAMILIES[prefix] = resolve


def _check_task_class(cls: Any, name: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise KvleagueError(f"task {name!r}: {cls!r} is not a Task subclass")
    if not dataclasses.is_dataclass(cls) or "__dataclass_fields__" not in cls.__dict__:
        raise KvleagueError(f"task {name!r}: {cls.__qualname__} must be decorated with @dataclass")
    domain = getattr(cls, "domain", None)
    if domain not in DOMAINS:
        raise KvleagueError(f"task {name!r}: domain {domain!r} is not one of {', '.join(DOMAINS)}")


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        try:
            cls = ep.load()
        except Exception as exc:  # report a broken plugin as one line
            raise KvleagueError(f"entry point {ep.name}={ep.value} in group {ENTRY_POINT_GROUP} failed to load: {exc}") from exc
        _check_task_class(cls, ep.name)
        if not cls.__dict__.get("name"):
            cls.name = ep.name
        _REGISTRY[ep.name] = cls


def available_tasks() -> dict[str, type[Task]]:
    """Every registered task (built-in and entry-point plugins), sorted by name."""
    _load_all()
    return dict(sorted(_REGISTRY.items()))


def task_class(name: str) -> type[Task]:
    tasks = available_tasks()
    if name in tasks:
        return tasks[name]
    prefix, sep, rest = name.partition(":")
    if sep and prefix in _FAMILIES:
        return _FAMILIES[prefix](rest)
    families = "".join(f", {p}:<name>" for p in sorted(_FAMILIES))
    raise KvleagueError(f"task: unknown {name!r}; valid names: {', '.join(tasks)}{families}")


def build_task(name: str, options: dict[str, Any] | None = None) -> Task:
    """Construct task ``name`` from a dict, validating every option name and type."""
    cls = task_class(name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in (options or {}).items():
        if key not in fields:
            allowed = ", ".join(fields) or "none"
            raise KvleagueError(f"task {name}: unknown option {key!r}; valid: {allowed}")
        try:
            kwargs[key] = TypeAdapter(hints[key]).validate_python(value)
        except ValidationError as exc:
            msg = exc.errors()[0]["msg"]
            raise KvleagueError(f"task {name}: option {key}={value!r}: {msg}") from None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # __post_init__ range checks
        raise KvleagueError(f"task {name}: {exc}") from None


def describe_task(cls: type[Task]) -> dict[str, Any]:
    """JSON-ready description: name, domain, size, metric, source, options."""
    return cls.describe()
