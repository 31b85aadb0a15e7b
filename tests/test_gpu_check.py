"""``scripts/gpu_check.sh`` read on the CPU: a GPU lease is minutes long, so a typo in one of its
command lines must fail here, not there. Every benchmark line parses with kvleague's own parser,
every test file it names exists, and the steps its header documents are the steps it runs. Its
benchmark lines that feed the targets table run here on a tiny llama, and ``kvleague bench targets``
must copy each figure from them (checked against the reports' own rows and summaries), judge it
only when it is a GPU figure at the target's settings, and size the bound from the model."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest

# minutes of Ray, subprocesses or a browser: the slow tier (KVLEAGUE_SLOW=1 bash scripts/test.sh)
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def _lines() -> list[str]:
    """The script's commands with continuation lines joined."""
    return SCRIPT.read_text().replace("\\\n", " ").splitlines()


def _bench_lines(with_report: bool = False) -> list[tuple]:
    """(step, arguments of ``kvleague bench``) per benchmark line; ``with_report``: (step, report
    name, arguments), the report being ``OUT/<name>.json``."""
    both = ["--backend", "hf", "--backend", "slab"]
    out = []
    for line in _lines():
        m = re.match(r"wants (\S+) && bench (\S+) (\d+) (.*)$", line.strip())
        if m:
            words = []
            for word in shlex.split(m.group(4)):
                words.extend(both if word == "${both[@]}" else [word])
            out.append((m.group(1), m.group(2), words) if with_report else (m.group(1), words))
    return out


def test_the_documented_steps_are_the_steps_it_runs():
    text = SCRIPT.read_text()
    documented = re.findall(r"^#   (\w+)\s{2,}", text, flags=re.M)
    default = re.search(r"GPU_CHECK_STEPS:-([^}]*)\}", text).group(1).split()
    run = re.findall(r"^wants (\w+) &&", text, flags=re.M)
    optional = re.findall(r"^#\s+(?:\S.*)?\(not among the default steps: GPU_CHECK_STEPS=(\w+)\)", text, flags=re.M)
    assert documented == run and default == [s for s in run if s not in optional]
    assert optional == ["refill"]  # continuous batching: measured when a lease has time left
    assert default[:4] == ["tests", "generate", "batch", "attention"]  # a short lease runs these first


@pytest.mark.parametrize("step, args", _bench_lines(), ids=[s for s, _ in _bench_lines()])
def test_every_benchmark_line_parses(step, args):
    from kvleague.cli import build_parser

    parsed = build_parser().parse_args(["bench", *args, "--model", "m", "--json", "out.json"])
    assert parsed.command == "bench"
    if "--static-anchor" in args:
        assert parsed.static_anchor is True
    if "hf" in args and "slab" in args:
        assert parsed.backend == ["hf", "slab"]


def test_the_test_files_it_names_exist():
    names = [w for line in _lines() if "pytest" in line for w in shlex.split(line) if w.startswith("tests/")]
    assert len(names) >= 3 and all((SCRIPT.parents[1] / n).is_file() for n in names)


# -- the targets table (`kvleague bench targets`) ---------------------------------------------------


#: the lengths the check's lines run at here (theirs take a minute on the CPU); argparse keeps the last
CPU_LENGTHS = {"--prompt-tokens": 96, "--new-tokens": 8, "--budget": 48}


def _lengths(args: list[str]) -> dict[str, int]:
    """A line's lengths by figure field (``prompt_tokens``, ``new_tokens``, ``budget``)."""
    return {flag[2:].replace("-", "_"): int(args[args.index(flag) + 1]) for flag in CPU_LENGTHS if flag in args}


@pytest.fixture(scope="module")
def check_folder(tiny_models, tmp_path_factory) -> Path:
    """The reports of the check's steps that feed the targets table, from its own command lines run
    on the CPU; only the model (a tiny llama) and the lengths (``CPU_LENGTHS``) differ."""
    from kvleague.cli import main
    from kvleague.runner.bench.gpu_targets import REPORTS

    out = tmp_path_factory.mktemp("gpu-check")
    lines = [(report, args) for _, report, args in _bench_lines(with_report=True) if report in REPORTS]
    assert sorted(r for r, _ in lines) == sorted(REPORTS)
    for report, args in lines:
        shorter = [w for flag, n in CPU_LENGTHS.items() if flag in args for w in (flag, str(n))]
        assert (
            main(
                ["bench", *args, *shorter, "--model", str(tiny_models["llama"]), "--json", str(out / f"{report}.json")]
            )
            == 0
        )
    return out


def _targets(folder: Path, *extra: str) -> dict:
    from kvleague.cli import main

    assert main(["bench", "targets", str(folder), *extra]) == 0
    return json.loads((folder / "targets.json").read_text())


def _from_the_report(folder: Path, target: dict, backend: str) -> float | None:
    """The target's figure found another way: in the report's rows and summary, not its figures."""
    report = json.loads((folder / f"{target['report']}.json").read_text())
    if backend not in (report["config"].get("backends") or [report["config"]["backend"]]):
        return None
    summary = report["summary"].get("by_backend", {}).get(backend, report["summary"])
    if target["metric"] == "decode_tokens_per_second":
        (value,) = [
            r["decode_tokens_per_second"]
            for r in report["rows"]
            if r["method"] == target["method"]
            and r.get("backend", backend) == backend
            and r.get("batch_size") == target["batch_size"]
        ]
        return value
    if target["metric"] == "first_pass_ratio":
        return summary["first_over_second_pass"]
    if target["batch_size"] is None:
        return summary["static_anchor"]["ratio_engine_over_static"]
    return summary["engine_over_static"][str(target["batch_size"])]["ratio"]


def test_targets_copy_each_figure_and_judge_none_from_a_cpu_run(check_folder):
    result = _targets(check_folder)
    assert len(result["rows"]) == 9 and result["bound_tokens_per_second_batch_1"] is None  # no CUDA, no bandwidth.json
    for row in result["rows"]:
        for backend, cell in row["cells"].items():
            expected = _from_the_report(check_folder, row["target"], backend)
            if expected is None:
                assert cell["value"] is None and cell["note"] == "backend not run"
            else:
                assert cell["value"] == expected
                assert cell["met"] is None and "CPU run" in cell["note"]
    text = (check_folder / "targets.md").read_text()
    assert "no figure here is a GPU figure" in text
    # each report says which path the slab backend's decode steps took (off CUDA: eager)
    slab = result["sources"]["batch"]["engines"]["slab"]
    assert slab["decode_steps"]["eager"] > 0 and slab["decode_steps"]["graph"] == 0 and slab["cuda_graphs"] == "off"
    assert f"slab: decode steps {slab['decode_steps']['eager']} eager" in text


def test_on_a_gpu_report_targets_are_judged_and_shared_against_the_bound(check_folder, engines, tmp_path):
    # the reports as a GPU would write them: a GPU named, each figure at its line's own lengths
    lengths = {report: _lengths(args) for _, report, args in _bench_lines(with_report=True)}
    for path in check_folder.glob("*.json"):
        report = json.loads(path.read_text())
        if "environment" in report:
            report["environment"].update(gpu_count=1, gpu_name="Test GPU")
            for fig in report["figures"]:
                for field, n in lengths[path.stem].items():
                    if field in fig["details"] or fig.get(field) is not None:
                        (fig if field in fig else fig["details"])[field] = n
            (tmp_path / path.name).write_text(json.dumps(report))
    model = engines["llama"].backend.model
    weights = 4 * sum(p.numel() for p in model.parameters())  # the reports ran float32 (tied weights once)
    result = _targets(tmp_path, "--bandwidth-gbs", "1000")
    bound = 1e12 / weights
    assert result["gpus"] == ["Test GPU"] and result["bound_tokens_per_second_batch_1"] == pytest.approx(bound)
    judged = 0
    for row in result["rows"]:
        t = row["target"]
        for _backend, cell in row["cells"].items():
            if cell["value"] is None:
                continue
            if t["reference"] == "generate_static":  # the CPU never compiles the anchor: not the target's
                assert cell["met"] is None and cell["note"] == "anchor not compiled, not the target's anchor"
                continue
            judged += 1
            assert cell["met"] == (cell["value"] >= t["target"])
            if t["decode_batch"]:
                assert cell["share_of_bound"] == pytest.approx(cell["value"] / (bound * t["decode_batch"]))
            else:
                assert cell["share_of_bound"] is None
    assert judged == 2 * 7  # both backends: six tokens/s rows and the first-pass ratio
    assert "Test GPU" in (tmp_path / "targets.md").read_text()

    # a figure at other settings is shown, not judged; a missing report or a failed anchor says so
    batch = json.loads((tmp_path / "batch.json").read_text())
    for fig in batch["figures"]:
        fig["details"]["prompt_tokens"] = 64
    (tmp_path / "batch.json").write_text(json.dumps(batch))
    (tmp_path / "static32.json").unlink()
    generate = json.loads((tmp_path / "generate.json").read_text())
    generate["figures"] = [f for f in generate["figures"] if f["reference"] != "generate_static"]
    generate["summary"]["by_backend"]["slab"]["static_anchor"] = {"error": "the compile failed", "compiled": True}
    (tmp_path / "generate.json").write_text(json.dumps(generate))
    # the folder rebuilt elsewhere: the bandwidth the check measured first, on its GPU
    (tmp_path / "bandwidth.json").write_text(json.dumps({"bytes_per_second": 2e12, "gpu": "Test GPU", "torch": "x"}))
    again = _targets(tmp_path)
    assert again["bound_tokens_per_second_batch_1"] == pytest.approx(2 * bound)
    assert again["bandwidth_source"] == "measured on Test GPU (bandwidth.json)"
    rows = {r["target"]["label"]: r["cells"] for r in again["rows"]}
    cell = rows["batch 32, `epikv` (tok/s)"]["slab"]
    assert cell["met"] is None and cell["value"] is not None and "prompt_tokens 64" in cell["note"]
    assert rows["`full` / `model.generate` (static cache + compile), batch 32"]["slab"]["note"] == "report missing"
    assert (
        rows["`full` / `model.generate` (static cache + compile), batch 1"]["slab"]["note"]
        == "anchor failed: the compile failed"
    )

    # a bandwidth measured on another GPU, or reports of different models, size no bound
    (tmp_path / "bandwidth.json").write_text(json.dumps({"bytes_per_second": 2e12, "gpu": "Other GPU", "torch": "x"}))
    assert _targets(tmp_path)["bound_tokens_per_second_batch_1"] is None
    (tmp_path / "bandwidth.json").unlink()
    batch["summary"]["by_backend"]["hf"]["engine"]["parameters"] += 1
    (tmp_path / "batch.json").write_text(json.dumps(batch))
    assert _targets(tmp_path, "--bandwidth-gbs", "1000")["bound_tokens_per_second_batch_1"] is None


def test_targets_refuse_what_is_not_a_check_folder(tmp_path, capsys):
    from kvleague.cli import main

    assert main(["bench", "targets", str(tmp_path / "absent")]) == 2
    assert main(["bench", "targets", str(tmp_path), "--bandwidth-gbs", "0"]) == 2
    assert "--bandwidth-gbs" in capsys.readouterr().err


# -- the script itself, run -------------------------------------------------------------------------


def test_the_script_runs_its_steps_on_the_cpu_when_asked_and_refuses_otherwise(tmp_path):
    """Its own plumbing (steps, limits, the model it builds, the summary, the targets step) run for real:
    ``GPU_CHECK_CPU=1`` on a tiny llama; without it, a machine with no CUDA device is exit 2."""
    import subprocess

    import torch

    env = {**os.environ, "KVLEAGUE_BENCH_MODELS": str(tmp_path / "models"), "OMP_NUM_THREADS": "1"}
    if not torch.cuda.is_available():
        refused = subprocess.run(
            ["bash", str(SCRIPT), str(tmp_path / "refused")], env=env, capture_output=True, text=True, timeout=120
        )
        assert refused.returncode == 2 and "torch sees no CUDA device (GPU_CHECK_CPU=1" in refused.stderr
    out = tmp_path / "check"
    run = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        env={**env, "GPU_CHECK_CPU": "1", "GPU_CHECK_STEPS": "tests cudnn"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = [line.split() for line in (out / "summary.txt").read_text().splitlines()]
    assert [(s[0], s[1]) for s in summary] == [
        ("cuda-tests", "rc=0"),
        ("model", "rc=0"),
        ("generate-cudnn", "rc=0"),
        ("targets", "rc=0"),
    ]
    assert (tmp_path / "models" / "llama-tiny" / "model.safetensors").is_file()
    report = json.loads((out / "generate-cudnn.json").read_text())
    assert report["config"]["cudnn_attention"] is True and "llama-tiny" in report["config"]["model"]
    assert "no figure here is a GPU figure" in (out / "targets.md").read_text()
