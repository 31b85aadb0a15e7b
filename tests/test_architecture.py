"""The structure README's "Where things are" promises, checked on the syntax tree of every module.

The backend seam: nothing above ``runner/engine/`` touches the model's cache or attention internals
(transformers' cache, mask and attention registries, the attention kernel switch, a model run over
a cache, the engine's model object); everything goes through the engine and its backend.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOP = ("methods", "tasks", "runner", "db", "dashboard")

#: transformers modules and names that are the model's cache and attention internals
INTERNAL_MODULES = ("transformers.cache_utils", "transformers.masking_utils", "transformers.modeling_utils",
                    "transformers.integrations")
INTERNAL_NAMES = {"DynamicCache", "DynamicLayer", "StaticCache", "Cache", "AttentionInterface",
                  "ALL_ATTENTION_FUNCTIONS", "ALL_MASK_ATTENTION_FUNCTIONS"}
#: attribute uses that reach into a model: the kernel switch, and the engine's model object
INTERNAL_ATTRIBUTES = {"set_attn_implementation", "past_key_values"}


def modules() -> list[Path]:
    return sorted(p for top in TOP for p in (REPO / top).rglob("*.py") if "migrations" not in p.parts)


def seam_violations(path: Path, source: str) -> list[str]:
    """Places in ``source`` where code outside the engine touches model internals."""
    out = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names}
            if node.module.startswith(INTERNAL_MODULES) or (node.module.startswith("transformers") and names & INTERNAL_NAMES):
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
        if rel.parts[:2] == ("runner", "engine"):
            continue
        violations += seam_violations(rel, path.read_text())
    assert not violations, "outside runner/engine/ (go through Engine / its backend):\n" + "\n".join(violations)


@pytest.mark.parametrize("snippet", [
    "from transformers import DynamicCache",
    "from transformers.cache_utils import DynamicLayer",
    "import transformers.masking_utils",
    "engine.model.set_attn_implementation('eager')",
    "out = model(ids, past_key_values=cache)",
    "params = engine.model.parameters()",
    "layer = self.engine.layers[0]",
])
def test_the_seam_check_finds_each_kind_of_reach(snippet):
    assert seam_violations(Path("x.py"), snippet)


def test_the_seam_check_lets_the_engines_api_through():
    assert not seam_violations(Path("x.py"), "from transformers import AutoTokenizer\nengine.describe()\nengine.backend.forward(x)")
