"""What the commands that read tasks' reference continuations (``kvleague fidelity``, ``kvleague
signals``) share: the task, refused in one line when it has no reference; its samples, bound to the
model's tokenizer first when the task counts in tokens; and their JSON reports, written atomically so
that a run interrupted mid-write leaves the previous report whole."""

from __future__ import annotations

import json
import os

from kvleague.engine.errors import KvleagueError

#: what a study scores as the answer: the task's reference continuation, the model's own greedy one (stops at
#: EOS), or its own greedy full-cache trace of exactly ``--max-tokens`` tokens after the prompt, special
#: tokens suppressed (``runner.fidelity.self_traces``, the paper's regime)
#: (here, not in ``runner.signals.study``, so that the CLI can list them without importing torch)
TRACES = ("reference", "greedy", "self")
#: where a signal study's occlusion windows slide: over the context before the answer (prompt included),
#: or over the answer's trace only, each window scored on the trace tokens after it (the EpiKV authors')
OCCLUDED = ("context", "trace")


def reference_task(name: str, options: list[str], why: str):
    """Task ``name`` with ``NAME=VALUE`` ``options``; a one-line error when it has no reference
    continuation (``why``: what the reference is needed for)."""
    from kvleague.runner.cli_args import parse_assignment
    from kvleague.tasks.registry import build_task

    task = build_task(name, dict(parse_assignment(o, "--option") for o in options))
    if not task.has_reference():
        raise KvleagueError(f"task: {name} has no reference continuation {why}")
    return task


def load_samples(task, tokenizer, limit: int, seed: int, data_dir: str | None) -> list:
    if task.tokenizer_dependent:
        task.bind_tokenizer(tokenizer)
    return task.load(limit=limit, seed=seed, data_dir=data_dir)


def write_report(path: str, report: dict) -> None:
    tmp = f"{path}.partial"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=1, default=str)
    os.replace(tmp, path)
