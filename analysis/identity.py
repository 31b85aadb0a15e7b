"""One sample is one sample: the content a ``(task id, sample id)`` row stands for, so that a prompt two task
rows hold counts once where their rows are pooled (a domain's tables, the report's totals).

The database stores no hash of the prompt or the reference, so the identity is derived, deterministically,
from what it does store: the task's name and options and the sample id.

* ``niah`` (tasks/niah.py): needle j of a task is the j-th draw of ``random.Random("kvleague-niah:<seed>")``,
  drawn depth by depth (``samples_per_depth`` per depth), and the prompt is the haystack of
  ``context_length`` units with that needle at that depth. Two niah rows hold the same prompt and reference
  exactly when they agree on length, unit, tokenizer, seed, depth and draw index, whatever their
  ``num_depths`` and ``samples_per_depth``: e.g. sample ``d0.250-2`` of the 5 x 4 variant is sample
  ``d0.250-0`` of the 5 x 6 one (draw 6 of both).
* every other task: its row and the sample id (options may change what a sample id holds).

Where rows are pooled, the copies of one content keep the row of the lowest ``(task id, sample id)``
present (:func:`representatives`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

_NIAH_ID = re.compile(r"^L(\d+)(tok|chr)-d(\d+\.\d{3})-(\d+)$")


def _niah_depths(options: Mapping[str, Any]) -> list[float]:
    """``tasks.niah.Niah.depths`` from stored options (importing the task would load torch)."""
    if options.get("depth") is not None:
        return [float(options["depth"])]
    n = int(options.get("num_depths", 11))
    return [0.5] if n == 1 else [round(i / (n - 1), 6) for i in range(n)]


def content_key(task: Mapping[str, Any], sample_id: str) -> Hashable:
    """What the row of ``sample_id`` of ``task`` (a tasks-table row: id, name, options) holds."""
    options = task.get("options") or {}
    if task.get("name") == "niah" and (m := _NIAH_ID.match(sample_id)):
        length, unit, depth, i = int(m[1]), m[2], float(m[3]), int(m[4])
        depths = [round(d, 3) for d in _niah_depths(options)]
        if depth in depths:
            draw = depths.index(depth) * int(options.get("samples_per_depth", 5)) + i
            return (
                "niah",
                length,
                unit,
                options.get("length_unit"),
                options.get("tokenizer"),
                int(options.get("seed", 0)),
                depth,
                draw,
            )
    return ("row", task.get("id"), json.dumps(options, sort_keys=True), sample_id)


#: task options that change what is scored or how, never the prompt: a prompt under two of them is one prompt
NOT_PROMPT_OPTIONS = frozenset({"fidelity_reference", "timeout_s"})


def prompt_key(task: Mapping[str, Any], sample_id: str) -> Hashable:
    """The prompt a row holds, whatever reference it is scored on (for counting distinct prompts: a math
    prompt under the dataset's reference and under the model's own continuation is one prompt)."""
    key: Any = content_key(task, sample_id)
    if key[0] != "row":
        return key
    options = {k: v for k, v in (task.get("options") or {}).items() if k not in NOT_PROMPT_OPTIONS}
    return ("prompt", task.get("name"), json.dumps(options, sort_keys=True), sample_id)


def representatives(
    questions: Iterable[tuple[int, str]], tasks: Mapping[int, Mapping[str, Any]]
) -> dict[tuple[int, str], tuple[int, str]]:
    """Each ``(task id, sample id)`` -> the lowest one among ``questions`` with the same content."""
    first: dict[Hashable, tuple[int, str]] = {}
    out = {}
    for qn in sorted(set(questions)):
        key = content_key({"id": qn[0], **tasks.get(qn[0], {})}, qn[1])
        out[qn] = first.setdefault(key, qn)
    return out


def pool(
    per_method: Mapping[int, Mapping[tuple, Any]], tasks: Mapping[int, Mapping[str, Any]]
) -> dict[int, dict[tuple, Any]]:
    """``method -> {key: value}`` with keys ``(task id, sample id, ...)``: the keys re-keyed to their content's
    representative, each method keeping the value of its lowest copy (a duplicate is dropped, not averaged:
    it is the same prompt, not a second draw)."""
    reps = representatives((k[:2] for keys in per_method.values() for k in keys), tasks)
    out: dict[int, dict[tuple, Any]] = {}
    for m, values in per_method.items():
        mine: dict[tuple, Any] = {}
        for k in sorted(values):
            mine.setdefault(reps[k[:2]] + tuple(k[2:]), values[k])
        out[m] = mine
    return out
