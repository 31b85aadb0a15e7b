"""``kvleague tasks`` and ``kvleague score``: subcommands contributed to the lead's CLI.

``register(subparsers)`` adds both; each parser sets ``func`` to a handler ``handler(args) -> int``
(the exit code). Handlers raise :class:`engine.errors.KvleagueError` for bad input (one line).

``kvleague score --task NAME --completions FILE.jsonl [--data-dir DIR] [--option K=V ...] [--json]``
reads lines ``{"sample_id": str, "completion": str}`` (several lines per sample are allowed: pass@k),
scores them with the task's scorer and prints the task's metrics; ``--json`` also prints every
per-sample result (sample id, completion, extracted answer, correctness, score, details, scorer
version).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvleague.engine.errors import KvleagueError
from kvleague.runner.cli_args import parse_assignment


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("tasks", help="list registered evaluation tasks (domain, size, data source)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_tasks)

    p = subparsers.add_parser("score", help="score a JSONL file of completions with a task's scorer")
    p.add_argument("--task", required=True, help="task name (see `kvleague tasks`)")
    p.add_argument("--completions", required=True, help='JSONL file of {"sample_id", "completion"} lines')
    p.add_argument("--data-dir", default=None, help="local data directory (default: $KVLEAGUE_DATA_DIR, else the Hub)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", help="task option (repeatable)")
    p.add_argument("--json", action="store_true", help="print metrics and per-sample results as JSON")
    p.set_defaults(func=cmd_score)


def _source_text(src: dict[str, Any]) -> str:
    if not src.get("hub_id") and not src.get("local_path"):  # a generated task (kv_agent): its source says how
        return src.get("url") or "no data source"
    hub = f"{src['hub_id']}@{src['revision']}" if src.get("hub_id") else "not on the Hub"
    return f"{hub}; local: {src.get('local_path')}"


def cmd_tasks(args: argparse.Namespace) -> int:
    from kvleague.tasks.registry import available_tasks, describe_task

    described = [describe_task(cls) for cls in available_tasks().values()]
    if getattr(args, "json", False):
        print(json.dumps(described, indent=2, default=str))
        return 0
    for d in described:
        size = "?" if d["size"] is None else str(d["size"])
        print(f"{d['name']:<28} {d['domain']:<8} {size:>6}  {_source_text(d['source'])}")
    return 0


COMPLETION_FIELDS = ("sample_id", "completion")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def read_completions(path: str | Path) -> list[tuple[str, str]]:
    """``(sample_id, completion)`` pairs of a JSONL file, validated line by line: each line an object
    with exactly ``sample_id`` (a string) and ``completion`` (a string, or JSON for agentic transcripts)."""
    p = Path(path)
    if not p.is_file():
        raise KvleagueError(f"--completions: {str(p)!r} is not a file")
    pairs = []
    with open(p, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"--completions: line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise KvleagueError(f"{where} is not UTF-8 text (byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise KvleagueError(f"{where} is not JSON ({exc.msg})") from None
            except RecursionError:
                raise KvleagueError(f"{where} is nested too deeply") from None
            if not isinstance(row, dict) or any(k not in row for k in COMPLETION_FIELDS):
                raise KvleagueError(f"{where} must be an object with keys sample_id and completion")
            extra = sorted(set(row) - set(COMPLETION_FIELDS))
            if extra:
                raise KvleagueError(
                    f"{where}: unknown field {_short(extra[0])}; allowed: {', '.join(COMPLETION_FIELDS)}"
                )
            sample_id, completion = row["sample_id"], row["completion"]
            if not isinstance(sample_id, str) or not sample_id:
                raise KvleagueError(f"{where}: sample_id must be a non-empty string, got {_short(sample_id)}")
            if isinstance(completion, (dict, list)):  # agentic transcripts may come as JSON
                try:
                    completion = json.dumps(completion)
                except RecursionError:
                    raise KvleagueError(f"{where} is nested too deeply") from None
            elif not isinstance(completion, str):
                raise KvleagueError(
                    f"{where}: completion must be a string (or a JSON object or list), got {_short(completion)}"
                )
            pairs.append((sample_id, completion))
    if not pairs:
        raise KvleagueError(f"--completions: {str(p)!r} has no completions")
    return pairs


def score_file(
    task_name: str, completions: str | Path, data_dir: str | None = None, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Score a completions file: ``{"task", "scorer_version", "metrics", "results"}``."""
    from kvleague.tasks.registry import build_task

    task = build_task(task_name, options or {})
    pairs = read_completions(completions)
    samples = {s.sample_id: s for s in task.load(data_dir=data_dir)}
    todo = []
    for sample_id, completion in pairs:
        if sample_id not in samples:
            some = ", ".join(list(samples)[:3])
            raise KvleagueError(
                f"--completions: unknown sample_id {_short(sample_id)} for task {task_name} (ids look like: {some})"
            )
        todo.append((samples[sample_id], completion))
    results = task.score_many(todo)
    per_sample = []
    for (sample, completion), r in zip(todo, results):
        row = r.to_dict()
        row["sample_id"] = sample.sample_id
        row["completion"] = completion
        row["scorer_version"] = task.scorer_version
        per_sample.append(row)
    return {
        "task": task_name,
        "options": task.option_values(),
        "scorer_version": task.scorer_version,
        "metric": task.metric,
        "metrics": task.aggregate(results),
        "results": per_sample,
    }


def cmd_score(args: argparse.Namespace) -> int:
    options = dict(parse_assignment(o, "--option") for o in getattr(args, "option", []) or [])
    report = score_file(args.task, args.completions, data_dir=args.data_dir, options=options)
    if getattr(args, "json", False):
        print(json.dumps(report, default=str))
        return 0
    metrics = report["metrics"]
    shown = "  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    print(f"{report['task']}  {shown}  (scorer {report['scorer_version']})")
    sys.stdout.flush()
    return 0
