"""``scripts/gpu_check.sh`` read on the CPU: a GPU lease is minutes long, so a typo in one of its
command lines must fail here, not there. Every benchmark line parses with kvleague's own parser,
every test file it names exists, and the steps its header documents are the steps it runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def _lines() -> list[str]:
    """The script's commands with continuation lines joined."""
    return SCRIPT.read_text().replace("\\\n", " ").splitlines()


def _bench_lines() -> list[tuple[str, list[str]]]:
    both = ["--backend", "hf", "--backend", "slab"]
    out = []
    for line in _lines():
        m = re.match(r"wants (\S+) && bench (\S+) (\d+) (.*)$", line.strip())
        if m:
            words = []
            for word in shlex.split(m.group(4)):
                words.extend(both if word == "${both[@]}" else [word])
            out.append((m.group(1), words))
    return out


def test_the_documented_steps_are_the_steps_it_runs():
    text = SCRIPT.read_text()
    documented = re.findall(r"^#   (\w+)\s{2,}", text, flags=re.M)
    default = re.search(r'GPU_CHECK_STEPS:-([^}]*)\}', text).group(1).split()
    run = re.findall(r"^wants (\w+) &&", text, flags=re.M)
    assert documented == default == run
    assert default[:4] == ["tests", "generate", "batch", "attention"]  # a short lease runs these first


@pytest.mark.parametrize("step, args", _bench_lines(), ids=[s for s, _ in _bench_lines()])
def test_every_benchmark_line_parses(step, args):
    from kvleague.runner.cli import build_parser

    parsed = build_parser().parse_args(["bench", *args, "--model", "m", "--json", "out.json"])
    assert parsed.command == "bench"
    if "--static-anchor" in args:
        assert parsed.static_anchor is True
    if "hf" in args and "slab" in args:
        assert parsed.backend == ["hf", "slab"]


def test_the_test_files_it_names_exist():
    names = [w for line in _lines() if "pytest" in line for w in shlex.split(line) if w.startswith("tests/")]
    assert len(names) >= 3 and all((SCRIPT.parents[1] / n).is_file() for n in names)
