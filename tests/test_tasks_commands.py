"""Handlers of ``kvleague tasks`` and ``kvleague score`` (runner.task_commands), called directly."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvleague.engine.errors import KvleagueError
from kvleague.runner.task_commands import cmd_score, cmd_tasks, register, score_file
from kvleague.tasks.registry import build_task

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvleague")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_register_adds_both_subcommands(tmp_path):
    parser = _parser()
    args = parser.parse_args(["tasks", "--json"])
    assert args.func is cmd_tasks and args.json
    args = parser.parse_args(
        ["score", "--task", "aime24", "--completions", "c.jsonl", "--data-dir", "d", "--option", "x=1", "--json"]
    )
    assert args.func is cmd_score and args.task == "aime24" and args.data_dir == "d" and args.option == ["x=1"]


def test_tasks_lists_domain_size_and_source(capsys):
    assert cmd_tasks(_parser().parse_args(["tasks", "--json"])) == 0
    listed = {d["name"]: d for d in json.loads(capsys.readouterr().out)}
    assert listed["math500"]["domain"] == "math" and listed["math500"]["size"] == 500
    assert listed["math500"]["source"]["hub_id"] == "HuggingFaceH4/MATH-500"
    assert listed["mbpp"]["source"]["local_path"] == "mbpp/sanitized-mbpp.json"
    assert cmd_tasks(_parser().parse_args(["tasks"])) == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert lines["humaneval"][1:3] == ["code", "164"]
    assert lines["gsm8k"][1:3] == ["math", "1319"]


def test_score_gold_and_wrong_completions(tmp_path, capsys):
    samples = build_task("aime25").load(data_dir=DATA_DIR)
    gold = _write(
        tmp_path / "gold.jsonl",
        [{"sample_id": s.sample_id, "completion": f"\\boxed{{{s.reference}}}"} for s in samples],
    )
    args = _parser().parse_args(
        ["score", "--task", "aime25", "--completions", str(gold), "--data-dir", str(DATA_DIR), "--json"]
    )
    assert cmd_score(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["metrics"]["accuracy"] == 1.0 and report["metrics"]["n"] == 30
    row = report["results"][0]
    assert row["sample_id"] == "I-1" and row["correct"] is True and row["extracted"] == "70"
    assert row["scorer_version"] == report["scorer_version"] and row["completion"] == "\\boxed{70}"

    wrong = _write(
        tmp_path / "wrong.jsonl", [{"sample_id": s.sample_id, "completion": "\\boxed{1000}"} for s in samples]
    )
    args = _parser().parse_args(["score", "--task", "aime25", "--completions", str(wrong), "--data-dir", str(DATA_DIR)])
    assert cmd_score(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("aime25 ") and "accuracy=0.0000" in out and "n=30" in out


@pytest.mark.usefixtures("code_sandbox")
def test_score_code_with_several_completions_per_sample(tmp_path):
    task = build_task("humaneval")
    a, b = task.load(data_dir=DATA_DIR)[:2]
    rows = [
        {"sample_id": a.sample_id, "completion": a.reference},
        {"sample_id": a.sample_id, "completion": "    return None\n"},
        {"sample_id": b.sample_id, "completion": "    raise NotImplementedError\n"},
        {"sample_id": b.sample_id, "completion": b.reference},
    ]
    report = score_file("humaneval", _write(tmp_path / "c.jsonl", rows), data_dir=str(DATA_DIR))
    assert [r["correct"] for r in report["results"]] == [True, False, False, True]
    assert report["metrics"]["pass@1"] == pytest.approx(0.5)
    assert report["metrics"]["n_samples"] == 2


def test_score_with_task_options(tmp_path):
    task = build_task("niah", {"context_length": 800, "num_depths": 2, "samples_per_depth": 1})
    samples = task.load(data_dir=DATA_DIR)
    rows = [{"sample_id": s.sample_id, "completion": s.reference} for s in samples]
    args = _parser().parse_args(
        [
            "score",
            "--task",
            "niah",
            "--completions",
            str(_write(tmp_path / "n.jsonl", rows)),
            "--data-dir",
            str(DATA_DIR),
            "--option",
            "context_length=800",
            "--option",
            "num_depths=2",
            "--option",
            "samples_per_depth=1",
        ]
    )
    report = score_file(
        args.task, args.completions, args.data_dir, {"context_length": 800, "num_depths": 2, "samples_per_depth": 1}
    )
    assert report["metrics"]["accuracy"] == 1.0 and report["options"]["context_length"] == 800
    assert cmd_score(args) == 0


@pytest.mark.parametrize(
    "content,match",
    [
        ('{"sample_id": "I-1", "completion": "x"}\nnot json\n', "line 2 is not JSON"),
        ('{"sample_id": "I-1"}\n', "line 1 must be an object with keys sample_id and completion"),
        ('{"sample_id": "nope", "completion": "x"}\n', "unknown sample_id 'nope' for task aime25"),
    ],
)
def test_score_rejects_bad_files(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(KvleagueError, match=match):
        score_file("aime25", path, data_dir=str(DATA_DIR))
    with pytest.raises(KvleagueError, match="is not a file"):
        score_file("aime25", tmp_path / "missing.jsonl", data_dir=str(DATA_DIR))
    with pytest.raises(KvleagueError, match="expected NAME=VALUE"):
        cmd_score(_parser().parse_args(["score", "--task", "aime25", "--completions", str(path), "--option", "oops"]))


def _unreachable_hub_env(tmp_path: Path) -> dict:
    """Hub access switched on, no data directory, an empty Hub cache, and the Hub at a loopback port
    nothing listens on."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "KVLEAGUE_DATA_DIR", "HF_HUB_CACHE")
    }
    env.update(
        HF_HOME=str(tmp_path / "hf"),
        HF_ENDPOINT=f"http://127.0.0.1:{port}",
        PYTHONPATH=str(Path(__file__).resolve().parents[1]),
    )
    return env


def test_an_unreachable_hub_fails_in_one_line_naming_the_data_dir(tmp_path):
    """Without a data directory and with the Hub down, one line naming --data-dir / KVLEAGUE_DATA_DIR,
    not five retries with backoff per request (~25 s) and their warnings."""
    import subprocess
    import sys

    env = _unreachable_hub_env(tmp_path)
    completions = _write(tmp_path / "c.jsonl", [{"sample_id": "HumanEval/0", "completion": "pass"}])
    out = subprocess.run(
        [sys.executable, "-m", "kvleague.cli", "score", "--task", "humaneval", "--completions", str(completions)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    source = build_task("humaneval").source
    assert out.returncode == 2
    assert out.stderr == (
        f"kvleague: error: dataset {source.dataset}: no local copy at <data-dir>/{source.local_path} (set --data-dir or "
        f"KVLEAGUE_DATA_DIR) and Hub id {source.hub_id}@{source.revision} failed (the Hub at {env['HF_ENDPOINT']} is "
        "unreachable and the Hub cache has no copy)\n"
    )


def test_an_unreachable_hub_still_loads_a_copy_in_the_hub_cache(tmp_path):
    """What offline mode loads, an unreachable Hub loads too: here a file of the L-Eval repository in the cache."""
    import shutil
    import subprocess
    import sys

    local = DATA_DIR / "leval" / "Closed-ended-tasks" / "coursera.jsonl"
    if not local.is_file():
        pytest.skip("no local L-Eval")
    env = _unreachable_hub_env(tmp_path)
    source = build_task("leval_coursera").source
    repo = tmp_path / "hf" / "hub" / f"datasets--{source.hub_id.replace('/', '--')}"
    commit = "a" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / source.revision).write_text(commit)
    cached = repo / "snapshots" / commit / source.hub_file
    cached.parent.mkdir(parents=True)
    shutil.copy(local, cached)
    code = "from kvleague.tasks.registry import build_task; print(len(build_task('leval_coursera').load(limit=3, seed=0, data_dir=None)))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3" and "Retry" not in out.stderr
