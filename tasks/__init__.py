"""Evaluation tasks: math, code, long-document QA and agentic (see :mod:`tasks.base` for the
contract and :mod:`tasks.registry` for lookup)."""

from kvleague.tasks.base import DataSource, Sample, ScoreResult, Task
from kvleague.tasks.registry import available_tasks, build_task, register_task, register_task_family, task_class

__all__ = [
    "DataSource",
    "Sample",
    "ScoreResult",
    "Task",
    "available_tasks",
    "build_task",
    "register_task",
    "register_task_family",
    "task_class",
]
