"""Run one cell, without Ray: :class:`CellWorker` loads a model once (per model spec), runs cells on
it and returns each cell's row. The scheduler (``runner.sweeping.scheduler``) wraps it in a Ray
actor; tests call it directly.

A cell that raises (bad output, a prompt longer than a protected budget) is a failed row with the
error; one that runs out of memory (CUDA, or the CPU cap ``memory_limit_gb``) is a failed row "out of
memory" and the worker goes on. A fidelity cell keeps the last sample's full-cache pass, so one pass
serves all of a sample's methods and budgets.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

from kvleague.db.spec_hash import canonical_json, spec_hash
from kvleague.runner.sweeping.grid import Cell

#: keys of an injected-failure rule that say what happens (the others select cells)
INJECTED_ACTIONS = ("message", "hang_seconds", "allocate_mb")


def _matches(cell: Cell, rule: dict[str, Any]) -> bool:
    values = {
        "method": cell.method,
        "budget": cell.budget,
        "task": cell.task,
        "sample_id": cell.sample_id,
        "seed": cell.seed,
        "sample_index": cell.sample_index,
        "model": cell.model["name"],
        "key": cell.key,
    }
    return all(k in INJECTED_ACTIONS or values.get(k) == v for k, v in rule.items())


def is_out_of_memory(exc: BaseException) -> bool:
    """CPU (MemoryError, torch's allocator under a memory cap) or accelerator (torch.OutOfMemoryError)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def _cap_address_space(limit_gb: float) -> None:
    """RLIMIT_AS = what this process has mapped now + ``limit_gb``: an allocation beyond it fails
    (MemoryError) in this worker instead of the kernel's OOM killer taking the node's processes."""
    import resource

    with open("/proc/self/statm") as fh:
        mapped = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = mapped + int(limit_gb * 1024**3)
    resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {Path(last.filename).name}:{last.lineno} in {last.name})"
    return text[:4000]


class CellWorker:
    """Loads a model once (per model spec) and runs cells on it."""

    def __init__(
        self,
        torch_threads: int | None = None,
        inject_failures: list[dict[str, Any]] | None = None,
        memory_limit_gb: float | None = None,
        worker_memory_gb: float | None = None,
    ):
        import torch

        from kvleague.engine.eager import set_worker_memory
        from kvleague.runner.provenance import collect_environment

        if torch_threads:
            torch.set_num_threads(torch_threads)
        if worker_memory_gb:  # the attention buffers are planned for the smaller of the two
            set_worker_memory(min(worker_memory_gb, memory_limit_gb or worker_memory_gb))
        if memory_limit_gb:
            _cap_address_space(memory_limit_gb)
        self.inject_failures = list(inject_failures or [])
        self.env = collect_environment()
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self._engine_key: str | None = None
        self._engine = None
        self._tasks: dict[str, Any] = {}
        #: the last sample's full-cache pass ``(key, (log-probabilities, targets), seconds)``: a
        #: sample's fidelity cells run back to back, so one pass serves all its methods and budgets
        self._reference: tuple[str, Any, float] | None = None
        #: self-generated reference traces (``fidelity.reference: self``) by sample, most recent last
        self._traces: dict[str, tuple[list[int], float]] = {}

    def ping(self) -> str:
        return self.worker

    def environment(self) -> dict[str, Any]:
        return self.env

    def _engine_for(self, model: dict[str, Any]):
        key = canonical_json(model)
        if key != self._engine_key:
            from kvleague.runner.models import load_engine

            self._engine = None
            self._engine_key = None
            self._reference = None
            free_accelerator_memory()
            self._engine = load_engine(
                model["resolved"],
                attn_implementation=model["attn_implementation"],
                dtype=model["dtype"],
                backend=model.get("backend", "hf"),
            )
            self._engine_key = key
        assert self._engine is not None
        return self._engine

    def _task(self, name: str, options: dict[str, Any]):
        key = canonical_json([name, options])
        if key not in self._tasks:
            from kvleague.tasks.registry import build_task

            self._tasks[key] = build_task(name, options)
        return self._tasks[key]

    def run(self, cell: Cell) -> dict[str, Any]:
        """Run one cell; never raises for a cell's own failure (the failure is the result)."""
        start = time.perf_counter()
        row = self._row(cell)
        oom = False
        try:
            for rule in self.inject_failures:
                if _matches(cell, rule):
                    self._inject(cell, rule)
            row.update(self._run(cell))
            row["status"] = "ok"
        except Exception as exc:
            oom = is_out_of_memory(exc)
            row.update(status="failed", error=("out of memory: " if oom else "") + error_text(exc))
        if oom:  # here, not in the except block, whose traceback still holds the failed cell's tensors
            free_accelerator_memory()
        row["wall_seconds"] = time.perf_counter() - start
        return row

    def run_group(self, cells: list[Cell], batch_size: int | str = "auto") -> list[dict[str, Any]]:
        """Run cells that decode together (``grid.batches``), ``batch_size`` rows at a time (the sweep's;
        ``auto``: what fits in memory, at most ``grid.AUTO_BATCH_LIMIT``), a finished row taken by the
        next cell (``Engine.generate_batch``); one row per cell, in order. A group of one, one with an
        injected failure, or one whose batch raised runs cell by cell, so every failure lands on its own cell."""
        if len(cells) == 1 or any(_matches(c, rule) for c in cells for rule in self.inject_failures):
            return [self.run(c) for c in cells]
        start = time.perf_counter()
        try:
            rows = self._run_batch(cells, batch_size)
        except Exception:
            free_accelerator_memory()
            return [self.run(c) for c in cells]
        share = (time.perf_counter() - start) / len(cells)  # the batch's wall time, split evenly
        return [{**self._row(c), **row, "status": "ok", "wall_seconds": share} for c, row in zip(cells, rows)]

    def _row(self, cell: Cell) -> dict[str, Any]:
        """What every row of this worker starts with: the cell it is for and where it ran."""
        return {"cell_key": cell.key, "worker": self.worker, "environment": self.env}

    def _run_batch(self, cells: list[Cell], batch_size: int | str) -> list[dict[str, Any]]:
        from kvleague.methods.registry import build_method
        from kvleague.runner.sample import run_samples
        from kvleague.runner.sweeping.grid import AUTO_BATCH_LIMIT

        first = cells[0]
        engine = self._engine_for(first.model)
        if first.measure == "fidelity":
            return self._run_fidelity_batch(cells, engine)
        runs = run_samples(
            engine,
            self._task(first.task, first.task_options),
            [c.sample for c in cells],
            [build_method(c.method, c.params) for c in cells],
            first.budget,
            first.protocol,
            _settings(first),
            [c.gen_seed for c in cells],
            rows=None if batch_size == "auto" else int(batch_size),
            max_rows=AUTO_BATCH_LIMIT,
        )
        return [
            _generation_row(
                run.score, run.generation, run.completion, {**run.details, "batch": {"cells": len(cells)}}, engine, c
            )
            for run, c in zip(runs, cells)
        ]

    def _inject(self, cell: Cell, rule: dict[str, Any]) -> None:
        """Test hooks (``--inject-failure``): hang, allocate (on the model's device), or raise."""
        if "hang_seconds" in rule:
            time.sleep(float(rule["hang_seconds"]))
        if "allocate_mb" in rule:
            import torch

            device = self._engine_for(cell.model).device
            block = torch.empty(int(rule["allocate_mb"]) * 1024**2, dtype=torch.uint8, device=device)
            del block
        if "message" in rule or ("allocate_mb" not in rule and "hang_seconds" not in rule):
            raise RuntimeError(rule.get("message") or f"injected failure for cell {cell.describe()}")

    def _run(self, cell: Cell) -> dict[str, Any]:
        from kvleague.methods.registry import build_method
        from kvleague.runner.sample import run_sample

        engine = self._engine_for(cell.model)
        task = self._task(cell.task, cell.task_options)
        method = build_method(cell.method, cell.params)
        if cell.measure == "fidelity":
            return self._run_fidelity(cell, engine, task, method, cell.protocol)
        run = run_sample(engine, task, cell.sample, method, cell.budget, cell.protocol, _settings(cell), cell.gen_seed)
        return _generation_row(run.score, run.generation, run.completion, run.details, engine, cell)

    def _run_fidelity(self, cell: Cell, engine, task, method, protocol) -> dict[str, Any]:
        """Teacher-force the sample's reference continuation under the method and compare every scored
        token with the full cache (``runner.fidelity.measure``)."""
        from kvleague.runner import fidelity

        segments, reference, reference_seconds, shared = self._fidelity_reference(cell, engine, task)
        r = fidelity.measure(engine, segments, method, cell.budget, protocol, seed=cell.gen_seed, reference=reference)
        return _fidelity_row(r, segments, reference_seconds, shared, engine, self._trace_seconds(cell, shared))

    def _run_fidelity_batch(self, cells: list[Cell], engine) -> list[dict[str, Any]]:
        """Fidelity cells of one sample (methods x budgets), or of a few whole samples when each is
        scored on its own trace (``grid.batches``): one full-cache pass per sample, the answers
        teacher-forced together (``runner.fidelity.measure_batch``)."""
        from kvleague.methods.registry import build_method
        from kvleague.runner import fidelity

        first = cells[0]
        self._prepare_traces(cells, engine)
        per_sample: dict[str, tuple] = {}  # sample id -> (segments, reference, its seconds, shared)
        per_cell = []
        for c in cells:
            if c.sample_id in per_sample:  # a later cell of the sample: its pass is shared
                per_cell.append((*per_sample[c.sample_id][:3], True))
            else:
                per_sample[c.sample_id] = self._fidelity_reference(
                    c, engine, self._task(c.task, c.task_options), keep_previous=True
                )
                per_cell.append(per_sample[c.sample_id])
        results = fidelity.measure_batch(
            engine,
            [p[0] for p in per_cell],
            [build_method(c.method, c.params) for c in cells],
            [c.budget for c in cells],
            first.protocol,
            [c.gen_seed for c in cells],
            [p[1] for p in per_cell],
        )
        rows = []
        for c, r, (segments, _, reference_seconds, shared) in zip(cells, results, per_cell):
            # the first cell of each sample paid its full-cache pass (and trace), if any did
            row = _fidelity_row(r, segments, reference_seconds, shared, engine, self._trace_seconds(c, shared))
            row["details"]["batch"] = {"cells": len(cells)}
            rows.append(row)
        return rows

    def _trace_key(self, cell: Cell) -> str:
        return canonical_json(
            [self._engine_key, cell.task, cell.task_options, cell.sample_id, cell.generation["max_new_tokens"]]
        )

    def _trace_seconds(self, cell: Cell, shared: bool) -> float | None:
        if cell.fidelity_reference != "self":
            return None
        return 0.0 if shared else self._traces[self._trace_key(cell)][1]

    def _prepare_traces(self, cells: list[Cell], engine) -> None:
        """The self-generated traces the cells need and this worker lacks, decoded together (greedy,
        full cache: each as it would be alone); a few recent ones are kept. With ``$KVLEAGUE_TRACE_CACHE``
        (a directory) a trace is also kept on disk under the hash of everything it depends on (model,
        dtype, prompt, length), so later sweeps on the same samples reuse the very same tokens; every
        row stores the scored tokens' hash either way."""
        from kvleague.runner import fidelity

        todo = {}
        for c in cells:
            if c.fidelity_reference == "self" and self._trace_key(c) not in self._traces:
                todo.setdefault(self._trace_key(c), c)
        if not todo:
            return
        store = os.environ.get("KVLEAGUE_TRACE_CACHE")
        prompts, files = {}, {}
        for key, c in todo.items():
            segments = self._task(c.task, c.task_options).fidelity_segments(c.sample, engine.tokenizer)
            prompt = fidelity.prompt_ids(segments)
            n = c.generation["max_new_tokens"]
            if store:
                files[key] = Path(store) / f"{spec_hash([c.model['resolved'], c.model['dtype'], prompt, n])}.json"
                if files[key].is_file():
                    self._traces[key] = (json.loads(files[key].read_text()), 0.0)
                    continue
            prompts[key] = prompt
        if prompts:
            start = time.perf_counter()
            traces = fidelity.self_traces(
                engine, list(prompts.values()), next(iter(todo.values())).generation["max_new_tokens"]
            )
            seconds = (time.perf_counter() - start) / len(traces)
            for key, trace in zip(prompts, traces):
                self._traces[key] = (trace, seconds)
                if key in files:
                    files[key].parent.mkdir(parents=True, exist_ok=True)
                    files[key].write_text(json.dumps(trace))
        while len(self._traces) > 64:
            self._traces.pop(next(iter(self._traces)))

    def _fidelity_reference(self, cell: Cell, engine, task, keep_previous: bool = False):
        """``(segments, full-cache log-probabilities, their seconds, shared)`` of the cell's sample;
        ``shared``: an earlier cell of the sample computed them (the last sample's pass is kept).
        Under ``fidelity.reference: self`` the scored segment is the sample's self-generated trace."""
        from kvleague.runner import fidelity

        segments = task.fidelity_segments(cell.sample, engine.tokenizer)
        if cell.fidelity_reference == "self":
            self._prepare_traces([cell], engine)
            segments = fidelity.self_trace_segments(segments, self._traces[self._trace_key(cell)][0])
        else:
            segments = fidelity.truncate(segments, cell.generation["max_new_tokens"])
        key = canonical_json([self._engine_key, cell.task, cell.task_options, cell.sample_id, segments])
        shared = self._reference is not None and self._reference[0] == key
        if not shared:
            if not keep_previous:
                self._reference = None  # free the previous sample's before computing the next
            start = time.perf_counter()
            reference = fidelity.full_cache_logprobs(engine, segments)
            self._reference = (key, reference, time.perf_counter() - start)
        assert self._reference is not None  # computed above, or shared
        _, reference, reference_seconds = self._reference
        return segments, reference, reference_seconds, shared


def _settings(cell: Cell):
    from kvleague.engine.protocol import GenerationSettings

    gen = cell.generation
    return GenerationSettings(
        max_new_tokens=gen["max_new_tokens"],
        temperature=gen["temperature"],
        top_p=gen["top_p"],
        stop=tuple(gen["stop"]),
    )


def _fidelity_row(
    r, segments, reference_seconds: float, shared: bool, engine, trace_seconds: float | None = None
) -> dict[str, Any]:
    """A fidelity cell's stored fields: KL, delta NLL and top-1 agreement, cost and cache figures;
    the scored tokens' hash, so an audit can check every method and budget saw the same ones."""
    from kvleague.runner import fidelity

    trace = {} if trace_seconds is None else {"self_trace_seconds": trace_seconds}
    return {
        "measure": "fidelity",
        "kl_mean": r.kl_mean,
        "delta_nll_mean": r.delta_nll_mean,
        "top1_agreement": r.top1_agreement,
        "scored_tokens": r.tokens,
        **_instrumentation(r.generation, engine),
        "resolved_budget": r.generation.budget,
        "details": {
            **_run_details(engine),
            "fidelity": {
                "kl_max": r.kl_max,
                "nll_full_mean": r.nll_full_mean,
                "nll_method_mean": r.nll_method_mean,
                "fed_tokens": sum(len(ids) for ids, _ in segments),
                "teacher_forced_seconds": r.seconds,
                # the full-cache pass: its time, and whether an earlier cell of this sample paid it
                "reference_seconds": reference_seconds,
                "reference_shared": shared,
                "scored_sha256": fidelity.trace_hash(segments),
                **trace,
            },
        },
    }


def _generation_row(score, generation, completion, details: dict[str, Any], engine, cell: Cell) -> dict[str, Any]:
    """A generation cell's stored fields: its score, completion, cost and cache figures, details (with
    ``budget_never_binds``, why, where the budget could never be reached)."""
    from kvleague.runner.budget_reach import never_binds

    unbound = never_binds(
        generation.budget,
        None if "episode" in details else generation.prompt_tokens,
        cell.generation["max_new_tokens"],
        engine.backend.max_positions,
        cell.protocol.positions,
    )
    if unbound:
        details = {**details, "budget_never_binds": unbound}
    return {
        "correct": bool(score.correct),
        "score": float(score.score),
        "extracted": None if score.extracted is None else str(score.extracted),
        "completion": completion,
        "stop_reason": generation.stop_reason,
        **_instrumentation(generation, engine),
        "resolved_budget": generation.budget,
        "details": {**details, **_run_details(engine)},
    }


def _run_details(engine) -> dict[str, Any]:
    """What every row records of how it was computed: the backend, and the worker's torch threads (CPU
    results are bitwise reproducible at a fixed count, which rounds differently from another;
    ``resources.torch_threads`` pins it, docs/engine.md)."""
    import torch

    return {"backend": engine.describe()["backend"], "torch_threads": torch.get_num_threads()}


def _instrumentation(generation, engine) -> dict[str, Any]:
    """A cell's cost and cache figures (``runner.metrics``), the same for generation and fidelity rows,
    and the Hub commit the checkpoint was loaded from (None for a local directory)."""
    from kvleague.runner.metrics import metrics  # imports torch: only where a cell runs

    return {**metrics(generation), "model_revision": engine.describe()["model_revision"]}


def free_accelerator_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass
