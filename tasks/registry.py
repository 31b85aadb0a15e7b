"""The task registry: ``@register_task`` on a dataclass in any module of this package (every module
is imported when the registry is first read; there is no list to edit), the ``kvleague.tasks``
entry-point group for third-party packages, name families resolved on demand (``lmeval:gsm8k``) and
validated construction from plain dicts (CLI, sweep configs). One implementation for methods and
tasks: :class:`engine.registry.Registry`.

Public API::

    register_task(name)                  class decorator for a Task dataclass
    register_task_family(prefix, resolve) names "prefix:rest" resolve to resolve(rest) -> Task class
    available_tasks() -> dict[str, type[Task]]   every registered task, sorted by name
    task_class(name) -> type[Task]       one-line KvleagueError listing valid names if unknown
    build_task(name, options=None) -> Task       options validated by field name and type
    describe_task(cls) -> dict           JSON-ready description (name, domain, size, source, options)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from kvleague.engine.errors import KvleagueError
from kvleague.engine.registry import Registry
from kvleague.tasks.base import DOMAINS, Task

ENTRY_POINT_GROUP = "kvleague.tasks"


def _check_domain(cls: type[Task], name: str) -> None:
    domain = getattr(cls, "domain", None)
    if domain not in DOMAINS:
        raise KvleagueError(f"task {name!r}: domain {domain!r} is not one of {', '.join(DOMAINS)}")


TASKS: Registry[type[Task]] = Registry(
    "task", Task, package="kvleague.tasks", group=ENTRY_POINT_GROUP, check=_check_domain
)

T = TypeVar("T", bound=type[Task])


def register_task(name: str) -> Callable[[T], T]:
    """Class decorator: register a ``Task`` dataclass under ``name``."""
    # the registry holds type[Task]; the decorator hands back the very class it was given
    return cast("Callable[[T], T]", TASKS.register(name))


def register_task_family(prefix: str, resolve: Callable[[str], type[Task]]) -> None:
    """Names ``"{prefix}:{rest}"`` resolve to ``resolve(rest)`` (a Task class, or a KvleagueError)."""
    TASKS.register_family(prefix, resolve)


def available_tasks() -> dict[str, type[Task]]:
    """Every registered task (built-in and entry-point plugins), sorted by name."""
    return TASKS.available()


def task_class(name: str) -> type[Task]:
    return TASKS.get(name)


def build_task(name: str, options: dict[str, Any] | None = None) -> Task:
    """Construct task ``name`` from a dict, validating every option name and type."""
    return TASKS.build(name, options)


def describe_task(cls: type[Task]) -> dict[str, Any]:
    """JSON-ready description: name, domain, size, metric, source, options."""
    return cls.describe()
