"""Named plugin classes: one registry implementation for eviction methods and tasks.

A :class:`Registry` maps names to dataclass subclasses of one base class. Classes arrive in two ways,
as in lm-eval-harness: the ``@register`` decorator, run when a module is imported, and entry points
of a package-metadata group (third-party packages; an entry point's name is the registered name).
Built-ins are found the way a plugin's module is: every module of the home package (``methods``,
``tasks``) is imported the first time the registry is read, so there is no hand-kept list of
built-in modules and a fresh clone that is not pip-installed still sees them all. Lookups and
construction from plain dicts (CLI flags, sweep YAML) raise one-line :class:`KvleagueError`\\ s.

The class lives in the ground floor because ``methods`` may import from ``runner`` only through
``engine``, and both ``methods`` and ``tasks`` need it.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from pydantic import TypeAdapter, ValidationError

from kvleague.engine.errors import KvleagueError

C = TypeVar("C", bound=type)


class Registry(Generic[C]):
    """Name -> class for one kind of plugin (``kind`` is the word the error messages use).

    ``base``: the class every entry must subclass (and be a dataclass of); ``package``: the package
    whose modules hold the built-ins; ``group``: the entry-point group of third-party plugins;
    ``check(cls, name)``: further checks of a class (raise :class:`KvleagueError`); ``fields(cls)``:
    the dataclass fields :meth:`build` accepts, called ``option_word`` in its messages.
    """

    def __init__(
        self,
        kind: str,
        base: type,
        package: str,
        group: str,
        *,
        option_word: str = "option",
        fields: Callable[[type], Iterable[dataclasses.Field]] = dataclasses.fields,
        check: Callable[[type, str], None] | None = None,
    ):
        self.kind, self.base, self.package, self.group = kind, base, package, group
        self.option_word, self.fields, self.extra_check = option_word, fields, check
        self.classes: dict[str, C] = {}
        #: prefix -> resolver: names "prefix:rest" resolve to resolver(rest) (e.g. ``lmeval:gsm8k``)
        self.families: dict[str, Callable[[str], C]] = {}
        self.loaded = False

    # -- registration ------------------------------------------------------------------------------

    def register(self, name: str) -> Callable[[C], C]:
        """Class decorator: register a dataclass subclass of ``base`` under ``name``."""

        def decorate(cls: C) -> C:
            self.check(cls, name)
            existing = self.classes.get(name)
            if existing is not None and existing is not cls:
                raise KvleagueError(
                    f"{self.kind} name {name!r} is registered twice ({existing.__module__} and {cls.__module__})"
                )
            cls.name = name
            self.classes[name] = cls
            return cls

        return decorate

    def register_family(self, prefix: str, resolve: Callable[[str], C]) -> None:
        """Names ``"{prefix}:{rest}"`` resolve to ``resolve(rest)`` (a class, or a KvleagueError)."""
        self.families[prefix] = resolve

    def check(self, cls: Any, name: str) -> None:
        base = self.base.__name__
        article = "an" if base[0].lower() in "aeiou" else "a"
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise KvleagueError(f"{self.kind} {name!r}: {cls!r} is not {article} {base} subclass")
        if not dataclasses.is_dataclass(cls) or "__dataclass_fields__" not in cls.__dict__:
            raise KvleagueError(f"{self.kind} {name!r}: {cls.__qualname__} must be decorated with @dataclass")
        if self.extra_check is not None:
            self.extra_check(cls, name)

    # -- loading -----------------------------------------------------------------------------------

    def load(self) -> None:
        """Import every module of the home package, then the entry-point plugins (once)."""
        if self.loaded:
            return
        self.loaded = True
        home = importlib.import_module(self.package)
        for module in pkgutil.iter_modules(home.__path__):
            if not module.name.startswith("_"):
                importlib.import_module(f"{self.package}.{module.name}")
        for ep in entry_points(group=self.group):
            if ep.name in self.classes:
                continue
            try:
                cls = ep.load()
            except Exception as exc:  # a broken plugin is one line, and must not hide the built-ins' names
                raise KvleagueError(
                    f"entry point {ep.name}={ep.value} in group {self.group} failed to load: {exc}"
                ) from exc
            self.check(cls, ep.name)
            if not cls.__dict__.get("name"):
                cls.name = ep.name
            self.classes[ep.name] = cls

    # -- lookup and construction -------------------------------------------------------------------

    def available(self) -> dict[str, C]:
        """Every registered class (built-in and entry-point plugins), sorted by name."""
        self.load()
        return dict(sorted(self.classes.items()))

    def get(self, name: str) -> C:
        """The class registered as ``name`` (or resolved by a family prefix); a one-line error listing the
        valid names otherwise."""
        classes = self.available()
        if name in classes:
            return classes[name]
        prefix, sep, rest = name.partition(":")
        if sep and prefix in self.families:
            return self.families[prefix](rest)
        families = "".join(f", {p}:<name>" for p in sorted(self.families))
        raise KvleagueError(f"{self.kind}: unknown {name!r}; valid names: {', '.join(classes)}{families}")

    def build(self, name: str, options: dict[str, Any] | None = None) -> Any:
        """Construct ``name`` from a dict, validating every field name and value by its type annotation."""
        cls = self.get(name)
        fields = [f.name for f in self.fields(cls)]  # declaration order, for the message
        hints = typing.get_type_hints(cls)
        word = self.option_word
        kwargs = {}
        for key, value in (options or {}).items():
            if key not in fields:
                allowed = ", ".join(fields) or "none"
                raise KvleagueError(f"{self.kind} {name}: unknown {word} {key!r}; valid: {allowed}")
            try:
                kwargs[key] = TypeAdapter(hints[key]).validate_python(value)
            except ValidationError as exc:
                msg = exc.errors()[0]["msg"]
                raise KvleagueError(f"{self.kind} {name}: {word} {key}={value!r}: {msg}") from None
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as exc:  # __post_init__ range checks
            raise KvleagueError(f"{self.kind} {name}: {exc}") from None
