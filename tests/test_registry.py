"""The one registry implementation (engine/registry.py) behind methods and tasks: built-ins
found by importing every module of their package (no hand-kept list), entry-point plugins, one-line
errors, and validated construction."""

from __future__ import annotations

import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvleague.engine.registry as generic
import kvleague.methods.registry as method_registry
from kvleague.engine.errors import KvleagueError
from kvleague.engine.registry import Registry
from kvleague.methods import EvictionMethod, available_methods, build_method, method_class, register_method
from kvleague.tasks import available_tasks

ROOT = Path(__file__).resolve().parents[1]
METHOD_NAME = re.compile(r'^@register_method\("([^"]+)"\)', re.M)
REGISTERS_TASKS = re.compile(
    r"^\s*(@|return )register_task\(|^\s*register_task\(f\"", re.M
)  # decorators, or a loop's calls


def test_every_builtin_in_the_package_is_registered():
    """Oracle: the package's source text, not the registry. Every ``@register_method("x")`` name is
    registered, and every module of ``tasks`` that registers a task contributes to the registry."""
    files = {f: f.read_text() for f in (ROOT / "methods").glob("*.py")}
    declared = {name for text in files.values() for name in METHOD_NAME.findall(text)}
    assert len(declared) >= 20 and set(available_methods()) == declared
    modules = {
        f"kvleague.tasks.{f.stem}" for f in (ROOT / "tasks").glob("*.py") if REGISTERS_TASKS.search(f.read_text())
    }
    assert {
        "kvleague.tasks.math",
        "kvleague.tasks.code",
        "kvleague.tasks.longqa",
        "kvleague.tasks.agentic",
        "kvleague.tasks.bfcl",
    } <= modules
    assert {cls.__module__ for cls in available_tasks().values()} == modules


@pytest.fixture
def toy_package(tmp_path, monkeypatch):
    """A package of three modules: two register classes, one private module must not be imported."""
    pkg = tmp_path / "toyplugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "registry.py").write_text(
        textwrap.dedent("""
        from dataclasses import dataclass
        from kvleague.engine.registry import Registry

        class Base:
            pass

        TOYS = Registry("toy", Base, package="toyplugins", group="kvleague.toys.test")
    """)
    )
    for name in ("alpha", "beta"):
        (pkg / f"{name}.py").write_text(
            textwrap.dedent(f"""
            from dataclasses import dataclass
            from toyplugins.registry import TOYS, Base

            @TOYS.register("{name}")
            @dataclass
            class Toy(Base):
                size: int = 1
        """)
        )
    (pkg / "_private.py").write_text("raise RuntimeError('a private module was imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for mod in [m for m in sys.modules if m == "toyplugins" or m.startswith("toyplugins.")]:
        del sys.modules[mod]


def test_a_new_module_in_the_package_is_found_without_any_list(toy_package):
    from toyplugins.registry import TOYS

    assert list(TOYS.available()) == ["alpha", "beta"]
    assert TOYS.build("beta", {"size": "3"}).size == 3  # coerced by the annotation
    with pytest.raises(KvleagueError, match=r"^toy beta: unknown option 'sise'; valid: size$"):
        TOYS.build("beta", {"sise": 3})
    with pytest.raises(KvleagueError, match=r"^toy: unknown 'gamma'; valid names: alpha, beta$"):
        TOYS.get("gamma")


def test_registry_checks_classes_and_names():
    reg = Registry("widget", EvictionMethod, package="methods", group="kvleague.widgets.test")

    class Plain:
        pass

    with pytest.raises(KvleagueError, match=r"^widget 'x': .* is not an EvictionMethod subclass$"):
        reg.register("x")(Plain)

    class NotDataclass(EvictionMethod):
        pass

    with pytest.raises(KvleagueError, match=r"^widget 'x': .*NotDataclass must be decorated with @dataclass$"):
        reg.register("x")(NotDataclass)

    @dataclass
    class One(EvictionMethod):
        pass

    @dataclass
    class Two(EvictionMethod):
        pass

    reg.register("x")(One)
    reg.register("x")(One)  # the same class again (a module imported twice) is fine
    with pytest.raises(KvleagueError, match=r"widget name 'x' is registered twice"):
        reg.register("x")(Two)


@pytest.fixture
def isolated_methods(monkeypatch):
    available_methods()
    monkeypatch.setattr(method_registry.METHODS, "classes", dict(method_registry.METHODS.classes))
    return method_registry.METHODS


def test_method_entry_point_plugins_are_registered(isolated_methods, monkeypatch):
    @dataclass
    class Newest(EvictionMethod):
        """Newest first."""

        bonus: float = 0.0

        def score(self, cache):
            return cache.token_positions.float() + self.bonus

    class FakeEntryPoint:
        name, value = "newest_plugin", "pkg:Newest"

        def load(self):
            return Newest

    groups = []
    monkeypatch.setattr(generic, "entry_points", lambda group: groups.append(group) or [FakeEntryPoint()])
    monkeypatch.setattr(isolated_methods, "loaded", False)
    assert method_class("newest_plugin") is Newest and Newest.name == "newest_plugin"
    assert groups == ["kvleague.methods"]
    assert build_method("newest_plugin", {"bonus": "2"}).bonus == 2.0
    with pytest.raises(KvleagueError, match=r"^method newest_plugin: unknown hyperparameter 'bonsu'; valid: bonus$"):
        build_method("newest_plugin", {"bonsu": 1})
    with pytest.raises(KvleagueError, match=r"^method newest_plugin: hyperparameter bonus='x': "):
        build_method("newest_plugin", {"bonus": "x"})


def test_broken_method_plugin_is_one_line(isolated_methods, monkeypatch):
    class Broken:
        name, value = "broken", "nowhere:Nothing"

        def load(self):
            raise ImportError("No module named 'nowhere'")

    monkeypatch.setattr(generic, "entry_points", lambda group: [Broken()])
    monkeypatch.setattr(isolated_methods, "loaded", False)
    with pytest.raises(
        KvleagueError, match=r"^entry point broken=nowhere:Nothing in group kvleague.methods failed to load: No module"
    ):
        available_methods()


def test_register_method_decorator_and_errors(isolated_methods):
    @register_method("value_norm_test")
    @dataclass
    class ValueNorm(EvictionMethod):
        p: float = 2.0

    assert available_methods()["value_norm_test"] is ValueNorm and ValueNorm.name == "value_norm_test"
    with pytest.raises(KvleagueError, match=r"method name 'full' is registered twice"):
        register_method("full")(ValueNorm)
    with pytest.raises(KvleagueError, match=r"^method: unknown 'fulll'; valid names: .*\bfull\b.*\bsnapkv\b"):
        method_class("fulll")
    with pytest.raises(KvleagueError, match=r"^method snapkv: kernel must be a positive odd integer, got 4$"):
        build_method("snapkv", {"kernel": 4})
