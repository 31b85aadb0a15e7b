"""The structure README's "Where things are" promises, checked on the syntax tree of every module.

Imports go one way, down the layers of :data:`LAYERS`, and no two modules import each other, however
indirectly: the graph is built from every import statement, those inside functions included (only
imports under ``if TYPE_CHECKING:`` never run, so they count for the layers but not for cycles).

The backend seam: nothing above ``engine/`` touches the model's cache or attention internals
(transformers' cache, mask and attention registries, the attention kernel switch, a model run over
a cache, the engine's model object); everything goes through the engine and its backend.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOP = ("engine", "methods", "tasks", "runner", "db", "analysis", "dashboard")

#: the layers, bottom first, as README's "Where things are" states them: a module imports its own
#: part and the layers below, never a layer above nor another part of its own layer. A part is a
#: package (or module) named by its dotted prefix; the longest prefix that matches a module wins.
LAYERS = (
    ("kvleague.engine",),  # the ground floor: generation, the method contract, errors
    ("kvleague.methods", "kvleague.tasks", "kvleague.db"),  # methods, tasks, the results database
    ("kvleague.analysis",),  # statistics, tables, the paper's claims, the report
    ("kvleague.runner", "kvleague.dashboard"),  # running (models, sweeps, benchmarks, studies); the Streamlit app
    ("kvleague",),  # the rest of kvleague/: the command line, registering every group
)

#: transformers modules and names that are the model's cache and attention internals
INTERNAL_MODULES = (
    "transformers.cache_utils",
    "transformers.masking_utils",
    "transformers.modeling_utils",
    "transformers.integrations",
)
INTERNAL_NAMES = {
    "DynamicCache",
    "DynamicLayer",
    "StaticCache",
    "Cache",
    "AttentionInterface",
    "ALL_ATTENTION_FUNCTIONS",
    "ALL_MASK_ATTENTION_FUNCTIONS",
}
#: attribute uses that reach into a model: the kernel switch, and the engine's model object
INTERNAL_ATTRIBUTES = {"set_attn_implementation", "past_key_values"}


def modules(root: Path = REPO) -> list[Path]:
    """Every module of the package: the top-level folders, and the command line's own files in
    ``kvleague/`` (whose links to those folders are not followed)."""
    tops = [p for top in TOP for p in (root / top).rglob("*.py") if "migrations" not in p.parts]
    return sorted(tops + [p for p in (root / "kvleague").glob("*.py") if p.name != "__init__.py"])


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str  # path:line
    type_only: bool  # under ``if TYPE_CHECKING:``: never runs

    def __str__(self) -> str:
        return f"{self.where}: {self.source} -> {self.target}" + (" (TYPE_CHECKING)" if self.type_only else "")


def module_names(root: Path = REPO) -> dict[str, Path]:
    """Dotted module name (under ``kvleague``, as installed) -> file, packages by their ``__init__.py``."""
    out = {}
    for path in modules(root):
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[1:] if parts[0] == "kvleague" else parts
        out[".".join(("kvleague", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return inside


def import_graph(root: Path = REPO) -> list[Edge]:
    """Every import of one project module by another, wherever the statement sits: ``import a.b`` and
    ``from a import b`` name module ``a.b`` when it is one, else the package ``a``."""
    names = module_names(root)

    def known(dotted: str) -> str | None:
        parts = dotted.split(".")
        while parts and ".".join(parts) not in names:
            parts.pop()
        return ".".join(parts) or None

    edges = []
    for name, path in names.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        type_only = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [
                    known(f"{base}.{a.name}") if f"{base}.{a.name}" in names else known(base) for a in node.names
                ]
            else:
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            edges += [Edge(name, t, where, id(node) in type_only) for t in dict.fromkeys(targets) if t and t != name]
    return edges


def _layer_of(module: str) -> tuple[int, str]:
    """(layer index, part) of a module: the part with the longest matching prefix."""
    matches = [
        (len(part), i, part)
        for i, parts in enumerate(LAYERS)
        for part in parts
        if module == part or module.startswith(part + ".")
    ]
    _, layer, part = max(matches)
    return layer, part


def layer_violations(edges: list[Edge]) -> list[str]:
    out = []
    for e in edges:
        (src_layer, src_part), (dst_layer, dst_part) = _layer_of(e.source), _layer_of(e.target)
        if src_part != dst_part and dst_layer >= src_layer:
            why = "a layer above" if dst_layer > src_layer else "another part of its own layer"
            out.append(f"{e}  [{src_part} may not import {dst_part}: {why}]")
    return out


def import_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """The edges inside each strongly connected component of the imports (Tarjan's algorithm). Imports
    under ``if TYPE_CHECKING:`` count: a cycle that only a type checker sees is still two modules that
    cannot be read, moved or tested one without the other."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [[e for e in edges if e.source in c and e.target in c] for c in components]


def test_imports_go_one_way_down_the_layers():
    violations = layer_violations(import_graph())
    assert not violations, "imports against the layer order (README, Where things are):\n" + "\n".join(violations)


def folder_of(module: str) -> str:
    """The top-level folder of a module: one of :data:`TOP`, else ``kvleague`` (the command line)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in TOP else "kvleague"


def folder_violations(edges: list[Edge]) -> list[str]:
    """Arrows between top-level folders that do not run strictly down the layers (each folder's layer
    is its package's: ``engine`` 0, ``methods``/``tasks``/``db`` 1, ``analysis`` 2, ``runner``/
    ``dashboard`` 3): at folder scale a picture of the imports is the picture of the layers."""
    layer = {folder_of(part): i for i, parts in enumerate(LAYERS) for part in parts if part.count(".") <= 1}
    out = set()
    for e in edges:
        src, dst = folder_of(e.source), folder_of(e.target)
        if src != dst and layer[dst] >= layer[src]:
            out.add(f"{src}/ -> {dst}/ ({e})")
    return sorted(out)


def test_folders_import_strictly_down_and_never_in_a_cycle():
    assert not folder_violations(import_graph())
    folder_edges = [
        Edge(folder_of(e.source), folder_of(e.target), e.where, e.type_only)
        for e in import_graph()
        if folder_of(e.source) != folder_of(e.target)
    ]
    assert not import_cycles(folder_edges)


def test_no_import_cycles_between_modules():
    cycles = import_cycles(import_graph())
    assert not cycles, "modules that import each other:\n" + "\n\n".join("\n".join(map(str, c)) for c in cycles)


#: what every layer imports for errors, names and plugins: no torch or transformers behind it (seconds to
#: import), so that the CLI's parser, the database, the analysis layer and the dashboard never pay for them
LIGHT_GROUND_FLOOR = (
    "kvleague.engine",
    "kvleague.engine.errors",
    "kvleague.engine.registry",
    "kvleague.engine.protocol",
    "kvleague.engine.contract",
    "kvleague.methods",
    "kvleague.methods.registry",
    "kvleague.tasks",
    "kvleague.tasks.base",
    "kvleague.tasks.registry",
)


def test_the_ground_floor_and_the_registries_import_without_torch():
    code = (
        "import importlib, json, sys\n"
        "for m in sys.argv[1:]: importlib.import_module(m)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *LIGHT_GROUND_FLOOR],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == [], f"importing {', '.join(LIGHT_GROUND_FLOOR)} loads {proc.stdout.strip()}"


DRIVER_WORK = """
import json, sys
from kvleague.runner.provenance import collect_environment
from kvleague.runner.sweep import expand
from kvleague.runner.sweep_config import parse_config
from kvleague.runner.sweeping.checks import check_config
config = parse_config({"name": "t", "database": "sqlite:///" + sys.argv[2], "models": [{"source": sys.argv[1]}],
                       "methods": ["full", "epikv", "h2o", "snapkv"], "budgets": [64], "tasks": [{"name": "kv_agent", "limit": 1}]})
check_config(config)
cells = expand(config).cells
env = collect_environment()
loaded = "transformers" in sys.modules
import transformers
print(json.dumps([len(cells), loaded, env["transformers_version"], transformers.__version__]))
"""


def test_a_sweep_driver_checks_plans_and_records_itself_without_transformers(tiny_models, tmp_path):
    """The driver builds every method to check a config, plans its cells and records its environment;
    transformers (~1.5 s to import, ~4 s under load, paid by every driver start) is for the workers."""
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER_WORK, str(tiny_models["llama"]), str(tmp_path / "t.db")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    n_cells, loaded, recorded, imported = json.loads(proc.stdout.splitlines()[-1])
    assert n_cells == 4 and not loaded
    assert recorded == imported  # the version recorded without the import is the one imported


def test_the_import_checker_catches_planted_violations(tmp_path):
    files = {
        "engine/__init__.py": "",
        "engine/errors.py": "def f():\n    from kvleague.runner import sweep  # inside a function\n",
        "runner/__init__.py": "",
        "runner/sweep.py": "from kvleague.dashboard import ui\n",
        "kvleague/cli.py": "from kvleague.dashboard import ui\nfrom kvleague.runner import sweep\n",
        "methods/__init__.py": "from kvleague.tasks.base import DOMAINS\n",
        "tasks/__init__.py": "",
        "tasks/base.py": "from kvleague.engine.errors import f\n",
        "db/__init__.py": "",
        "analysis/__init__.py": "",
        "dashboard/__init__.py": "",
        "dashboard/ui.py": "from . import views\n",
        "dashboard/views.py": "def g():\n    from kvleague.dashboard.ui import main\n",
        "dashboard/types.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvleague.dashboard.ui import x\n",
        "analysis/stats.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvleague.dashboard.ui import x\n",
        "db/a.py": "from kvleague.db.b import y\n",
        "db/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvleague.db.a import z\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    edges = import_graph(tmp_path)
    found = {v.split(": ", 1)[1].split("  [")[0].replace("kvleague.", "") for v in layer_violations(edges)}
    assert found == {
        "engine.errors -> runner.sweep",
        "runner.sweep -> dashboard.ui",
        "methods -> tasks.base",
        "analysis.stats -> dashboard.ui (TYPE_CHECKING)",
    }  # the cli may
    cycles = import_cycles(edges)
    assert sorted(sorted(str(e).split(": ", 1)[1].replace("kvleague.", "") for e in c) for c in cycles) == [
        ["dashboard.ui -> dashboard.views", "dashboard.views -> dashboard.ui"],
        ["db.a -> db.b", "db.b -> db.a (TYPE_CHECKING)"],
    ]  # a cycle only a type checker sees counts too
    assert [v.split(" (")[0] for v in folder_violations(edges)] == [
        "analysis/ -> dashboard/",
        "engine/ -> runner/",
        "methods/ -> tasks/",
        "runner/ -> dashboard/",
    ]


def bare_imports(path: Path, source: str) -> list[str]:
    """Imports of a top-level folder by its bare name (``from tasks import ...``): outside the
    ``kvleague`` namespace they would load a second copy of a module (two registries), or a user's
    own ``tasks`` package."""
    out = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        )
        out += [f"{path}:{node.lineno}: {name}" for name in names if name.split(".")[0] in TOP]
    return out


def test_every_import_of_kvleague_goes_through_its_namespace():
    sources = [*modules(), *sorted((REPO / "tests").glob("*.py"))]
    found = [v for path in sources for v in bare_imports(path.relative_to(REPO), path.read_text())]
    assert not found, "imports of kvleague's folders by their bare names (use kvleague.<folder>):\n" + "\n".join(found)
    assert bare_imports(Path("x.py"), "import runner.cli\nfrom tasks import base\nfrom kvleague.db import store") == [
        "x.py:1: runner.cli",
        "x.py:2: tasks",
    ]


def test_pyproject_installs_every_package_under_kvleague():
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        "kvleague." + ".".join(init.parent.relative_to(REPO).parts)
        for top in TOP
        for init in (REPO / top).rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == folders | {"kvleague"}
    assert "package-dir" not in setuptools  # the links below are the mapping: no import hook for tools to miss
    links = {p.name: os.readlink(p) for p in (REPO / "kvleague").iterdir() if p.is_symlink()}
    assert links == {top: f"../{top}" for top in TOP}


def seam_violations(path: Path, source: str) -> list[str]:
    """Places in ``source`` where code outside the engine touches model internals."""
    out = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names}
            if node.module.startswith(INTERNAL_MODULES) or (
                node.module.startswith("transformers") and names & INTERNAL_NAMES
            ):
                out.append(f"{path}:{node.lineno}: from {node.module} import {', '.join(sorted(names))}")
        elif isinstance(node, ast.Import):
            out += [f"{path}:{node.lineno}: import {a.name}" for a in node.names if a.name.startswith(INTERNAL_MODULES)]
        elif isinstance(node, ast.Attribute) and node.attr in INTERNAL_ATTRIBUTES:
            out.append(f"{path}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg in INTERNAL_ATTRIBUTES:
            out.append(f"{path}:{getattr(node.value, 'lineno', '?')}: {node.arg}=")
        elif isinstance(node, ast.Attribute) and node.attr in ("model", "layers") and _names_engine(node.value):
            out.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return out


def _names_engine(node: ast.AST) -> bool:
    """``engine`` / ``self.engine`` / ``x.backend``: an engine or its backend."""
    if isinstance(node, ast.Name):
        return node.id in ("engine", "backend")
    return isinstance(node, ast.Attribute) and node.attr in ("engine", "backend")


def test_nothing_above_the_engine_touches_the_models_cache_or_attention():
    violations = []
    for path in modules():
        rel = path.relative_to(REPO)
        if rel.parts[0] == "engine":
            continue
        violations += seam_violations(rel, path.read_text())
    assert not violations, "outside engine/ (go through Engine / its backend):\n" + "\n".join(violations)


@pytest.mark.parametrize(
    "snippet",
    [
        "from transformers import DynamicCache",
        "from transformers.cache_utils import DynamicLayer",
        "import transformers.masking_utils",
        "engine.model.set_attn_implementation('eager')",
        "out = model(ids, past_key_values=cache)",
        "params = engine.model.parameters()",
        "layer = self.engine.layers[0]",
    ],
)
def test_the_seam_check_finds_each_kind_of_reach(snippet):
    assert seam_violations(Path("x.py"), snippet)


def test_the_seam_check_lets_the_engines_api_through():
    assert not seam_violations(
        Path("x.py"), "from transformers import AutoTokenizer\nengine.describe()\nengine.backend.forward(x)"
    )


# ------------------------------------------------------------------------------------------------
# README's map names every module
# ------------------------------------------------------------------------------------------------


def readme_map(readme: str) -> dict[str, str]:
    """Folder -> its row of the table under README's "Where things are"."""
    section = readme.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`") and cells[0].endswith("/`"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def unmapped_modules(root: Path, readme: str) -> list[str]:
    """Modules not named (``name.py``, in backticks) in the row of the deepest folder that holds them.
    An eviction method's own file is covered by the methods/ row's "one file per eviction method"."""
    rows = readme_map(readme)
    missing = []
    for path in modules(root):
        rel = path.relative_to(root).as_posix()
        if path.name == "__init__.py" or (rel.startswith("methods/") and "@register_method(" in path.read_text()):
            continue
        folder = max((f for f in rows if rel.startswith(f)), key=len, default=None)
        if folder is None or f"`{rel[len(folder) :]}`" not in rows[folder]:
            missing.append(f"{rel} (row {folder or 'none'})")
    return missing


def test_readme_map_names_every_module():
    missing = unmapped_modules(REPO, (REPO / "README.md").read_text())
    assert not missing, 'modules README\'s "Where things are" does not name:\n' + "\n".join(missing)


def test_the_map_check_finds_a_module_missing_from_its_row(tmp_path):
    for folder in ("engine", "runner"):
        (tmp_path / folder).mkdir()
    for rel in ("engine/errors.py", "engine/new.py", "runner/cli.py"):
        (tmp_path / rel).write_text("")
    readme = (
        "## Where things are\n\n| folder | what |\n|---|---|\n| `engine/` | errors (`errors.py`) |\n"
        "| `runner/` | the CLI (`cli.py`), `new.py` is named here, not in its own folder's row |\n\n## Next\n"
    )
    assert unmapped_modules(tmp_path, readme) == ["engine/new.py (row engine/)"]
