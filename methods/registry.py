"""The method registry: ``@register_method`` on a dataclass in any module of this package (every
module is imported when the registry is first read; there is no list to edit), the
``kvleague.methods`` entry-point group for third-party packages, and validated construction from plain
dicts (CLI, sweep configs). One implementation for methods and tasks: :class:`engine.registry.Registry`."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any, TypeVar, cast

from kvleague.engine.contract import EvictionMethod
from kvleague.engine.registry import Registry

ENTRY_POINT_GROUP = "kvleague.methods"

METHODS: Registry[type[EvictionMethod]] = Registry(
    "method",
    EvictionMethod,
    package="kvleague.methods",
    group=ENTRY_POINT_GROUP,
    option_word="hyperparameter",
    fields=lambda cls: cls.hyperparameters(),
)

M = TypeVar("M", bound=type[EvictionMethod])


def register_method(name: str) -> Callable[[M], M]:
    """Class decorator: register an ``EvictionMethod`` dataclass under ``name``."""
    # the registry holds type[EvictionMethod]; the decorator hands back the very class it was given
    return cast("Callable[[M], M]", METHODS.register(name))


def available_methods() -> dict[str, type[EvictionMethod]]:
    """Every registered method (built-in and entry-point plugins), sorted by name."""
    return METHODS.available()


def method_class(name: str) -> type[EvictionMethod]:
    return METHODS.get(name)


def build_method(name: str, params: dict[str, Any] | None = None) -> EvictionMethod:
    """Construct method ``name`` from a dict, validating every hyperparameter name and type."""
    return METHODS.build(name, params)


def describe(cls: type[EvictionMethod]) -> dict[str, Any]:
    """JSON-ready description: name, summary, hyperparameters with types and defaults, needs."""
    hints = typing.get_type_hints(cls)
    params = []
    for f in cls.hyperparameters():
        default = f.default if f.default is not dataclasses.MISSING else None
        params.append({"name": f.name, "type": _type_name(hints[f.name]), "default": default})
    doc = (cls.__doc__ or "").strip().splitlines()
    return {
        "name": cls.name,
        "class": f"{cls.__module__}:{cls.__qualname__}",
        "summary": doc[0] if doc else "",
        "hyperparameters": params,
        "needs": dataclasses.asdict(cls.needs),
    }


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
