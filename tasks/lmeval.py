"""``lmeval:NAME``: any lm-eval ``generate_until`` task as a kvleague task.

The prompt is lm-eval's own context for the document (description, few-shot examples with lm-eval's
sampler seeded like lm-eval's CLI, ``doc_to_text``); generation stops at the task's ``until`` strings
after ``max_gen_toks`` tokens; scoring applies the task's own filter pipelines and
``process_results`` (so its own metrics), and :meth:`LmEvalTask.aggregate` uses the task's own
aggregation functions. Metric keys follow lm-eval: ``"exact_match,strict-match"``; the headline
metric is the task's first metric under its first filter.

Options: ``include_path`` (folders with extra task YAMLs; default ``$KVLEAGUE_LMEVAL_INCLUDE_PATH``),
``num_fewshot`` (default: the task's), ``apply_chat_template`` (render the context with the
tokenizer's chat template through lm-eval, like ``lm_eval --apply_chat_template``; default off, like
lm-eval), ``fewshot_seed`` (lm-eval's default 1234).

Data: lm-eval loads the task's dataset itself (``datasets``). Offline, use a task YAML with
``dataset_path: json`` and local ``data_files`` in an include path.

This module does not import lm-eval until a ``lmeval:`` task is used, so listing tasks stays fast.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvleague.engine.errors import KvleagueError
from kvleague.tasks.base import DataSource, Sample, ScoreResult, Task
from kvleague.tasks.registry import register_task_family

PREFIX = "lmeval"
INCLUDE_ENV = "KVLEAGUE_LMEVAL_INCLUDE_PATH"
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default when a task sets no max_gen_toks
_LOCK = threading.Lock()
_MANAGERS: dict[Any, Any] = {}
_LOADED: dict[Any, tuple[Any, list[dict[str, Any]]]] = {}
_CLASSES: dict[str, type[LmEvalTask]] = {}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _manager(include: str | None, defaults: bool):
    from lm_eval.tasks import TaskManager

    key = (include, defaults)
    if key not in _MANAGERS:
        paths: list[str | Path] | None = [p for p in include.split(os.pathsep) if p] if include else None
        _MANAGERS[key] = TaskManager(include_path=paths, include_defaults=defaults)
    return _MANAGERS[key]


def _py(value: Any) -> Any:
    """numpy scalars -> Python scalars (JSON-ready)."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return value.item()
    if isinstance(value, tuple):
        return [_py(v) for v in value]
    return value


def guess_domain(name: str) -> str:
    lowered = name.lower()
    if any(k in lowered for k in ("humaneval", "mbpp", "code")):
        return "code"
    if any(k in lowered for k in ("qa", "longbench", "ruler", "niah", "scrolls", "squad", "triviaqa", "drop")):
        return "longqa"
    return "math"


@dataclass
class LmEvalTask(Task):
    """An lm-eval generate_until task, prompted, filtered and scored by lm-eval itself."""

    include_path: str | None = None
    num_fewshot: int | None = None
    apply_chat_template: bool = False
    fewshot_seed: int = 1234

    lm_task: ClassVar[str] = ""
    domain: ClassVar[str] = "math"
    source: ClassVar[DataSource] = DataSource(
        dataset="lm-eval task",
        hub_id=None,
        revision=None,
        local_path=None,
        license="that of the lm-eval task's dataset",
        url="the lm-eval task YAML (dataset_path / dataset_name / data_files)",
    )
    size: ClassVar[int | None] = None
    protect_prompt: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"num_fewshot: must be >= 0 or null, got {self.num_fewshot}")

    # -- the lm-eval task -----------------------------------------------------------------------------
    def _include(self) -> str | None:
        return self.include_path or os.environ.get(INCLUDE_ENV) or None

    def lm_eval_task(self):
        """The lm-eval task object and its evaluation documents (built once per process)."""
        include = self._include()
        key = (self.lm_task, include, self.num_fewshot, self.fewshot_seed)
        with _LOCK:
            if key not in _LOADED:
                _LOADED[key] = self._build(include)
            return _LOADED[key]

    def _build(self, include: str | None):
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            raise KvleagueError(
                f"task {self.name}: needs the lm-eval package (pip install 'kvleague[lmeval]')"
            ) from None
        manager = _manager(include, defaults=False) if include else None
        if manager is None or self.lm_task not in manager.all_tasks:
            manager = _manager(include, defaults=True)
        if self.lm_task not in manager.all_tasks:
            where = (
                f"lm-eval's built-in tasks and {include}"
                if include
                else f"lm-eval's built-in tasks (add yours with include_path or ${INCLUDE_ENV})"
            )
            raise KvleagueError(
                f"task: lm-eval has no task {self.lm_task!r} in {where}; list them with: lm-eval ls tasks"
            )
        try:
            loaded = manager.load(self.lm_task)
        except Exception as exc:  # dataset download failures offline, bad YAML...
            raise KvleagueError(
                f"task {self.name}: lm-eval could not build it ({_first_line(exc)}); offline, point a task YAML at local "
                f"files (dataset_path: json, data_files) via include_path or ${INCLUDE_ENV}"
            ) from None
        tasks = loaded["tasks"]
        if len(tasks) != 1:
            raise KvleagueError(
                f"task {self.name}: is a group of {len(tasks)} lm-eval tasks; name one: {', '.join(sorted(tasks))}"
            )
        task = next(iter(tasks.values()))
        if task.OUTPUT_TYPE != "generate_until":
            raise KvleagueError(
                f"task {self.name}: output_type is {task.OUTPUT_TYPE!r}; allowed: generate_until (kvleague scores generations)"
            )
        if self.num_fewshot is not None:
            task.set_config("num_fewshot", self.num_fewshot)
        task.set_fewshot_seed(self.fewshot_seed)
        return task, list(task.eval_docs)

    def _gen_kwargs(self) -> dict[str, Any]:
        task, _ = self.lm_eval_task()
        return dict(task.config.generation_kwargs or {})

    def _shots(self) -> int:
        task, _ = self.lm_eval_task()
        return int(task.config.num_fewshot or 0)

    # -- generation defaults read from the task -----------------------------------------------------
    @property
    def stop(self) -> tuple[str, ...]:  # type: ignore[override]
        until = self._gen_kwargs().get("until") or ()
        return (until,) if isinstance(until, str) else tuple(until)

    @property
    def max_new_tokens(self) -> int:  # type: ignore[override]
        return int(self._gen_kwargs().get("max_gen_toks") or DEFAULT_MAX_GEN_TOKS)

    @property
    def metric(self) -> str:  # type: ignore[override]
        task, _ = self.lm_eval_task()
        return f"{next(iter(task._metric_fn_list))},{task._filters[0].name}"

    # -- data -----------------------------------------------------------------------------------------
    def load_records(self, data_dir: Path | None) -> list[Sample]:
        task, docs = self.lm_eval_task()
        task.set_fewshot_seed(self.fewshot_seed)  # the same few-shot draws as an lm-eval run in doc order
        samples = []
        for doc_id, doc in enumerate(docs):
            context = task.fewshot_context(doc, num_fewshot=self._shots(), gen_prefix=task.doc_to_prefix(doc))
            target = task.doc_to_target(doc)
            samples.append(
                Sample(
                    sample_id=f"{self.lm_task}-{doc_id}",
                    task=self.name,
                    prompt=context,
                    reference={"doc_id": doc_id, "target": _py(target)},
                    metadata={"doc_id": doc_id, "lm_eval_task": self.lm_task},
                )
            )
        return samples

    def _doc(self, sample: Sample) -> tuple[Any, dict[str, Any], int]:
        task, docs = self.lm_eval_task()
        doc_id = int(sample.reference["doc_id"])
        if not 0 <= doc_id < len(docs):
            raise KvleagueError(
                f"sample_id: {sample.sample_id} has doc_id {doc_id}, task {self.name} has {len(docs)} documents"
            )
        return task, docs[doc_id], doc_id

    # -- prompting ------------------------------------------------------------------------------------
    def build_prompt(self, sample: Sample, tokenizer: Any) -> list[int]:
        """lm-eval's context as plain text (tokenizer's default special tokens, as the ``kvleague``
        lm-eval model does), or rendered by lm-eval with the chat template when
        ``apply_chat_template`` is set."""
        if self.apply_chat_template and getattr(tokenizer, "chat_template", None):
            task, doc, _ = self._doc(sample)

            def render(history, add_generation_prompt=True):
                return tokenizer.apply_chat_template(
                    history,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=not add_generation_prompt,
                )

            text = task.fewshot_context(
                doc,
                num_fewshot=self._shots(),
                apply_chat_template=True,
                chat_template=render,
                gen_prefix=task.doc_to_prefix(doc),
            )
            return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
        return [int(i) for i in tokenizer(sample.prompt)["input_ids"]]

    # -- scoring --------------------------------------------------------------------------------------
    def score(self, sample: Sample, completion: str) -> ScoreResult:
        from lm_eval.api.instance import Instance

        task, doc, doc_id = self._doc(sample)
        instance = Instance("generate_until", doc, (sample.prompt, self._gen_kwargs()), 0, (self.lm_task, doc_id, 1))
        instance.resps = [completion]
        for ensemble in task._filters:
            ensemble.apply([instance])
        metrics: dict[str, Any] = {}
        extracted: dict[str, Any] = {}
        for filter_name, response in instance.filtered_resps.items():
            extracted[filter_name] = _py(response)
            for metric, value in task.process_results(doc, [response]).items():
                metrics[f"{metric},{filter_name}"] = _py(value)
        head = self.metric
        value = metrics.get(head)
        numeric = isinstance(value, (int, float))  # bools included
        score = float(value) if numeric else 0.0
        first = extracted.get(task._filters[0].name)
        return ScoreResult(
            correct=bool(numeric and score >= 1.0),
            score=score,
            extracted=None if first is None else str(first),
            details={"metrics": metrics, "filtered": extracted, "headline": head},
            sample_id=sample.sample_id,
        )

    def aggregate(self, results: Sequence[ScoreResult]) -> dict[str, Any]:
        out = super().aggregate(results)
        if not results:
            return out
        task, _ = self.lm_eval_task()
        aggregations = task.aggregation()
        keys = list(results[0].details.get("metrics", {}))
        for key in keys:
            metric = key.split(",", 1)[0]
            values = [r.details["metrics"][key] for r in results if key in r.details.get("metrics", {})]
            fn = aggregations.get(metric)
            if fn is not None and values:
                out[key] = _py(fn(values))
        return out

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {
            "name": cls.name,
            "domain": cls.domain,
            "size": None,
            "metric": "the lm-eval task's first metric under its first filter",
            "scorer_version": cls.scorer_version,
            "summary": f"lm-eval task {cls.lm_task!r}, prompted and scored by lm-eval",
            "source": cls.source.describe(),
            "options": [
                {
                    "name": f.name,
                    "type": str(f.type),
                    "default": f.default if f.default is not dataclasses.MISSING else None,
                }
                for f in dataclasses.fields(cls)
            ],
            "class": f"{cls.__module__}:{cls.__qualname__}",
        }


def lmeval_task_class(rest: str) -> type[LmEvalTask]:
    """The kvleague task class for ``lmeval:<rest>`` (one class per lm-eval task name)."""
    if not rest or not re.fullmatch(r"[A-Za-z0-9_.\-]+", rest):
        raise KvleagueError(
            f"task: {PREFIX}:{rest!r} needs an lm-eval task name of letters, digits, '_', '.', '-' (e.g. {PREFIX}:gsm8k)"
        )
    with _LOCK:
        if rest not in _CLASSES:
            cls = type(
                f"LmEval_{re.sub(r'[^A-Za-z0-9_]', '_', rest)}",
                (LmEvalTask,),
                {
                    "__doc__": f"lm-eval task {rest!r}, prompted, filtered and scored by lm-eval.",
                    "lm_task": rest,
                    "domain": guess_domain(rest),
                },
            )
            cls = dataclass(cls)
            cls.name = f"{PREFIX}:{rest}"
            _CLASSES[rest] = cls
        return _CLASSES[rest]


register_task_family(PREFIX, lmeval_task_class)
