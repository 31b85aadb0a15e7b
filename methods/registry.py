"""Method registry: ``@register_method`` for in-tree methods, the ``kvleague.methods`` entry-point
group for third-party packages, and validated construction from plain dicts (CLI, sweep configs)."""

from __future__ import annotations

import dataclasses
import importlib
import typing
from importlib.metadata import entry_points
from typing import Any, Callable, TypeVar

from pydantic import TypeAdapter, ValidationError

from runner.engine.contract import EvictionMethod
from runner.engine.errors import KvleagueError

ENTRY_POINT_GROUP = "kvleague.methods"
_BUILTIN_MODULES = (
    "methods.full",
    "methods.streaming_llm",
    "methods.random_eviction",
    "methods.knorm",
    "methods.epikv",
    "methods.epikv_bands",
    "methods.epikv_seg",
    "methods.lag_kv",
    "methods.h2o_authors",
    "methods.thinkv_authors",
    "methods.raas_authors",
    "methods.rkv_authors",
    "methods.longflow_authors",
    "methods.kv_variance",
    "methods.hs_variance",
    "methods.h2o",
    "methods.tova",
    "methods.snapkv",
    "methods.rkv",
    "methods.thinkv",
    "methods.keydiff",
    "methods.scissorhands",
    "methods.raas",
    "methods.lazy_eviction",
)

_REGISTRY: dict[str, type[EvictionMethod]] = {}
_loaded = False

M = TypeVar("M", bound=type[EvictionMethod])


def register_method(name: str) -> Callable[[M], M]:
    """Class decorator: register an ``EvictionMethod`` dataclass under ``name``."""

    def decorate(cls: M) -> M:
        _check_method_class(cls, name)
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise KvleagueError(f"method name {name!r} is registered twice ({existing.__module__} and {cls.__module__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def _check_method_class(cls: Any, name: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, EvictionMethod)):
        raise KvleagueError(f"method {name!r}: {cls!r} is not an EvictionMethod subclass")
    if not dataclasses.is_dataclass(cls) or "__dataclass_fields__" not in cls.__dict__:
        raise KvleagueError(f"method {name!r}: {cls.__qualname__} must be decorated with @dataclass")


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
        except Exception as exc:  # a broken plugin must not take the whole registry down
            raise KvleagueError(f"entry point {ep.name}={ep.value} in group {ENTRY_POINT_GROUP} failed to load: {exc}") from exc
        _check_method_class(cls, ep.name)
        if not cls.__dict__.get("name"):
            cls.name = ep.name
        _REGISTRY[ep.name] = cls


def available_methods() -> dict[str, type[EvictionMethod]]:
    """Every registered method (built-in and entry-point plugins), sorted by name."""
    _load_all()
    return dict(sorted(_REGISTRY.items()))


def method_class(name: str) -> type[EvictionMethod]:
    methods = available_methods()
    if name not in methods:
        raise KvleagueError(f"method: unknown {name!r}; valid names: {', '.join(methods)}")
    return methods[name]


def build_method(name: str, params: dict[str, Any] | None = None) -> EvictionMethod:
    """Construct method ``name`` from a dict, validating every field name and type."""
    cls = method_class(name)
    fields = {f.name: f for f in cls.hyperparameters()}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in (params or {}).items():
        if key not in fields:
            allowed = ", ".join(fields) or "none"
            raise KvleagueError(f"method {name}: unknown hyperparameter {key!r}; valid: {allowed}")
        try:
            kwargs[key] = TypeAdapter(hints[key]).validate_python(value)
        except ValidationError as exc:
            msg = exc.errors()[0]["msg"]
            raise KvleagueError(f"method {name}: hyperparameter {key}={value!r}: {msg}") from None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # __post_init__ range checks
        raise KvleagueError(f"method {name}: {exc}") from None


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
