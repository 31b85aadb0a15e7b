"""Run a sweep on Ray and store every cell's result in SQL.

    python runner/sweep.py --config sweeps/demo.yaml            # starts a local Ray on 127.0.0.1
    kvleague sweep --config sweeps/demo.yaml                    # the same
    ray job submit --working-dir . -- python runner/sweep.py --config sweeps/demo.yaml

The grid (models x methods x hyperparameter grid x budgets x tasks x samples x n_samples x seeds)
becomes cells; each cell has a deterministic key (a SHA-256 of everything that determines its
generation), and cells whose key already has a row are skipped, so an interrupted sweep resumes
where it stopped and a finished one re-runs in seconds without writing anything.

A task entry with ``measure: fidelity`` (or ``both``) also makes *fidelity* cells: one per (model,
method, budget, sample, seed) - teacher forcing samples nothing, so no ``n_samples``; a method that
never evicts (full) only at the first budget, as it is the same at every budget - that feed the
task's reference continuation (cut at ``fidelity.max_scored_tokens``) under the method and compare
every scored token with the full cache (``runner/fidelity.py``). Their key hashes ``measure:
fidelity`` and the token cap in place of the generation settings and sample index, so it can never
equal a generation cell's key (whose spec is unchanged: existing databases resume as before). A
worker keeps the last sample's full-cache pass, and a sample's fidelity cells are queued together,
so with one worker each sample's full-cache pass runs once for all its methods and budgets (with n
workers, at most n times).

Cells run on Ray actors (one per GPU, or one per ``cpus_per_worker`` CPUs without GPUs); an actor
keeps the model it loaded and serves many cells. Actors restart (``max_restarts``) and their calls
are retried (``max_task_retries``); a cell whose worker keeps dying is stored as failed after
``max_cell_attempts``. A cell that raises (bad output, a prompt longer than a protected budget) is
stored as failed with the error and the sweep goes on; one that runs out of memory (CUDA, or the
CPU cap ``memory_limit_gb``) is stored as failed "out of memory" and its worker goes on; one that
runs past ``cell_timeout_seconds`` is stored as failed and its worker killed and replaced. Results
stream back to this driver, the only database writer, which writes them in batches: workers need no
database access. A lost database (a server restarting) does not stop the sweep: finished results
wait in the driver and are written when it is back (``db_retry_seconds``). Every write is
idempotent and the database's unique ``cell_key`` holds one row per cell, so a driver killed at any
point, or two drivers on one sweep, leave exactly one row per finished cell; re-running resumes.
"""

from __future__ import annotations

if __name__ == "__main__" and __package__ in (None, ""):
    # ``python runner/sweep.py`` puts runner/ on sys.path, not the repository root: fix that, then
    # run the module under its real name (Ray pickles the worker class by module path).
    import sys as _sys
    from pathlib import Path as _Path

    _root = str(_Path(__file__).resolve().parent.parent)
    _here = str(_Path(__file__).resolve().parent)
    _sys.path[:] = [p for p in _sys.path if p != _here]
    if _root not in _sys.path:
        _sys.path.insert(0, _root)
    from runner.sweep import main as _main

    raise SystemExit(_main())

import argparse
import collections
import json
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from runner.engine.errors import KvleagueError, first_line
from runner.sweep_config import (
    SweepConfig,
    canonical_json,
    check_config,
    clip,
    load_config,
    project_dir,
    resolve_data_dir,
    resolve_model_source,
    sha256,
)

#: environment variables a worker gets from the driver (offline mode, caches, data)
FORWARDED_ENV = ("HF_HUB_OFFLINE", "HF_HOME", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "KVLEAGUE_DATA_DIR",
                 "TOKENIZERS_PARALLELISM")
LOCAL_OBJECT_STORE_BYTES = 300 * 1024**2


# ------------------------------------------------------------------------------------------------
# Cells
# ------------------------------------------------------------------------------------------------


@dataclass
class Cell:
    """One unit of work: everything a worker needs, nothing that needs the database."""

    key: str
    model: dict[str, Any]  # source (as written), resolved (absolute path or Hub id), dtype, attn_implementation, name
    method: str
    params: dict[str, Any]
    budget: int
    task: str
    task_options: dict[str, Any]
    domain: str
    sample: Any  # tasks.base.Sample
    sample_index: int
    seed: int  # the config's seed
    gen_seed: int  # the seed the sampler gets (seed for sample 0, derived for the others)
    protocol: dict[str, Any]
    generation: dict[str, Any]  # max_new_tokens, temperature, top_p, stop
    dims: dict[str, str] = field(default_factory=dict)  # dimension -> spec_hash
    attempts: int = 0
    #: "generation" or "fidelity" (then ``generation["max_new_tokens"]`` is the cap on scored tokens)
    measure: str = "generation"

    @property
    def sample_id(self) -> str:
        return self.sample.sample_id

    def describe(self) -> str:
        what = " fidelity" if self.measure == "fidelity" else ""
        return f"{self.model['name']} {self.method} B={self.budget} {self.task}/{self.sample_id}#{self.sample_index} seed={self.seed}{what}"


def cell_key(spec: dict[str, Any]) -> str:
    return sha256(spec)


def derived_seed(seed: int, index: int) -> int:
    if index == 0:
        return seed
    return int(sha256({"seed": seed, "sample_index": index})[:8], 16) & 0x7FFFFFFF


@dataclass
class Grid:
    cells: list[Cell]
    dims: dict[str, dict[str, dict[str, Any]]]  # dimension -> spec_hash -> row values
    warnings: list[str]


def expand(config: SweepConfig, base_dir: Path | None = None) -> Grid:
    """Cells of ``config`` in a deterministic order (grouped by model, then task and sample)."""
    from methods.registry import build_method
    from tasks.registry import build_task, task_class

    base = base_dir or project_dir()
    warnings = check_config(config, base)
    data_dir = resolve_data_dir(config, base)
    dims: dict[str, dict[str, dict[str, Any]]] = collections.defaultdict(dict)

    methods = []  # (name, canonical params, spec hash, budgets of its fidelity cells)
    for entry in config.methods:
        for point in entry.points():
            built = build_method(entry.name, point)
            params = built.params()
            h = sha256({"name": entry.name, "params": params})
            dims["method"][h] = {"spec_hash": h, "name": entry.name, "params": params, "params_json": canonical_json(params)}
            # teacher forcing under a method that never evicts is the same at every budget: measured once
            methods.append((entry.name, params, h, config.budgets[:1] if built.never_evicts else config.budgets))
        non_eager = sorted({m.attn_implementation for m in config.models} - {"eager"})
        if built.needs.eager and non_eager and not any(f"method {entry.name}:" in w for w in warnings):
            warnings.append(f"method {entry.name}: needs eager attention (full attention columns), so its cells run "
                            f"eager instead of {'/'.join(non_eager)}: slower, and attn_implementation says so per result")

    def plan_task(entry, tokenizer, model_source: str | None):
        """(entry, task, samples, protocol, generation, task hash, protocol hash, generation hash)"""
        cls = task_class(entry.name)
        task = build_task(entry.name, entry.options)
        if tokenizer is not None:
            task.bind_tokenizer(tokenizer)
        try:
            samples = task.load(limit=entry.limit, seed=entry.sample_seed, data_dir=data_dir)
        except KvleagueError as exc:
            raise KvleagueError(f"tasks: {entry.name}: {exc}") from None
        if not samples:
            warnings.append(f"task {entry.name}: no samples")
        options = task.option_values()
        source = cls.source
        t_spec = {
            "name": entry.name, "domain": cls.domain, "options": options, "dataset": source.dataset,
            "source": source.hub_id or source.url, "revision": source.revision,
            "scorer_version": str(cls.scorer_version), "metric": cls.metric,
        }
        if model_source is not None:  # lengths in this model's tokens: a different task per model
            t_spec["options"] = {**options, "length_unit": f"tokens of {model_source}"}
        t_hash = sha256(t_spec)
        dims["task"][t_hash] = {"spec_hash": t_hash, **t_spec}
        protocol = config.resolved_protocol(cls.domain, cls.protect_prompt)
        p_hash = sha256(protocol)
        dims["protocol"][p_hash] = {"spec_hash": p_hash, **protocol}
        gen = {
            "max_new_tokens": entry.max_new_tokens or config.generation.max_new_tokens or int(cls.max_new_tokens),
            "temperature": float(config.generation.temperature),
            "top_p": float(config.generation.top_p),
            "stop": list(config.generation.stop if config.generation.stop is not None else cls.stop),
        }
        g_hash = sha256(gen)
        dims["generation"][g_hash] = {"spec_hash": g_hash, **gen}
        # a fidelity cell's settings: at most this many scored tokens, teacher-forced (nothing sampled)
        fid = {"max_new_tokens": int(config.fidelity.max_scored_tokens), "temperature": 0.0, "top_p": 1.0, "stop": []}
        f_hash = sha256(fid)
        if "fidelity" in entry.measures:
            dims["generation"][f_hash] = {"spec_hash": f_hash, **fid}
        return (entry, task, samples, protocol, {"generation": (gen, g_hash), "fidelity": (fid, f_hash)}, t_hash, p_hash)

    entries = []
    for entry in config.tasks:
        try:
            entries.append((entry, task_class(entry.name).tokenizer_dependent))
        except KvleagueError:
            continue  # optional and unregistered (check_config warned)
    shared = {i: plan_task(entry, None, None) for i, (entry, per_model) in enumerate(entries) if not per_model}

    cells: list[Cell] = []
    for model_cfg in config.models:
        model = {
            "name": model_cfg.label,
            "source": model_cfg.source,
            "resolved": resolve_model_source(model_cfg.source, base),
            "dtype": model_cfg.dtype,
            "attn_implementation": model_cfg.attn_implementation,
        }
        m_spec = {k: model[k] for k in ("source", "dtype", "attn_implementation")}
        m_hash = sha256(m_spec)
        dims["model"][m_hash] = {"spec_hash": m_hash, "name": model["name"], "revision": None, **m_spec}
        tokenizer = None
        if any(per_model for _, per_model in entries):
            tokenizer = load_tokenizer(model["resolved"])
        tasks = [shared[i] if i in shared else plan_task(entry, tokenizer, model_cfg.source)
                 for i, (entry, _) in enumerate(entries)]
        for entry, task, samples, protocol, settings, t_hash, p_hash in tasks:
            for sample in samples:
                for measure in entry.measures:
                    gen, g_hash = settings[measure]
                    # fidelity is teacher-forced: one cell per seed, never n_samples of them
                    for index in range(config.generation.n_samples if measure == "generation" else 1):
                        for seed in config.seeds:
                            for name, params, meth_hash, fidelity_budgets in methods:
                                for budget in (config.budgets if measure == "generation" else fidelity_budgets):
                                    spec = {
                                        "model": m_spec, "method": name, "params": params, "budget": budget,
                                        "task": entry.name, "task_options": task.option_values(),
                                        "sample_id": sample.sample_id, "protocol": protocol, "seed": seed,
                                    }
                                    if measure == "generation":  # the spec generation cells always had
                                        spec.update(sample_index=index, generation=gen)
                                    else:
                                        spec.update(measure=measure, max_scored_tokens=gen["max_new_tokens"])
                                    cells.append(
                                        Cell(
                                            key=cell_key(spec), model=model, method=name, params=params, budget=budget,
                                            task=entry.name, task_options=task.option_values(), domain=task.domain,
                                            sample=sample, sample_index=index, seed=seed,
                                            gen_seed=derived_seed(seed, index), protocol=protocol, generation=gen,
                                            dims={"model": m_hash, "method": meth_hash, "task": t_hash,
                                                  "protocol": p_hash, "generation": g_hash},
                                            measure=measure,
                                        )
                                    )
    keys = [c.key for c in cells]
    if len(set(keys)) != len(keys):  # a task returning the same sample id twice
        raise KvleagueError("tasks: two cells share a key (a task returned duplicate sample ids)")
    return Grid(cells=cells, dims=dict(dims), warnings=warnings)


def load_tokenizer(model_spec: str):
    """The tokenizer of a model spec (converting a GGUF model on first use; no weights loaded)."""
    from transformers import AutoTokenizer

    from runner.models.source import resolve_model

    try:
        return AutoTokenizer.from_pretrained(resolve_model(model_spec))
    except OSError as exc:
        raise KvleagueError(f"models: cannot load the tokenizer of {model_spec!r}: {first_line(exc)}") from None


# ------------------------------------------------------------------------------------------------
# The worker (a Ray actor; plain class so it can be tested without Ray)
# ------------------------------------------------------------------------------------------------


#: keys of an injected-failure rule that say what happens (the others select cells)
INJECTED_ACTIONS = ("message", "hang_seconds", "allocate_mb")


def _matches(cell: Cell, rule: dict[str, Any]) -> bool:
    values = {"method": cell.method, "budget": cell.budget, "task": cell.task, "sample_id": cell.sample_id,
              "seed": cell.seed, "sample_index": cell.sample_index, "model": cell.model["name"], "key": cell.key}
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


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {Path(last.filename).name}:{last.lineno} in {last.name})"
    return text[:4000]


class CellWorker:
    """Loads a model once (per model spec) and runs cells on it."""

    def __init__(self, torch_threads: int | None = None, inject_failures: list[dict[str, Any]] | None = None,
                 memory_limit_gb: float | None = None):
        import torch

        from runner.provenance import collect_environment

        if torch_threads:
            torch.set_num_threads(torch_threads)
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

    def ping(self) -> str:
        return self.worker

    def environment(self) -> dict[str, Any]:
        return self.env

    def _engine_for(self, model: dict[str, Any]):
        key = canonical_json(model)
        if key != self._engine_key:
            from runner.models import load_engine

            self._engine = None
            self._engine_key = None
            self._reference = None
            _free_accelerator_memory()
            self._engine = load_engine(model["resolved"], attn_implementation=model["attn_implementation"], dtype=model["dtype"])
            self._engine_key = key
        return self._engine

    def _task(self, name: str, options: dict[str, Any]):
        key = canonical_json([name, options])
        if key not in self._tasks:
            from tasks.registry import build_task

            self._tasks[key] = build_task(name, options)
        return self._tasks[key]

    def run(self, cell: Cell) -> dict[str, Any]:
        """Run one cell; never raises for a cell's own failure (the failure is the result)."""
        start = time.perf_counter()
        row: dict[str, Any] = {"cell_key": cell.key, "worker": self.worker, "environment": self.env}
        oom = False
        try:
            for rule in self.inject_failures:
                if _matches(cell, rule):
                    self._inject(cell, rule)
            row.update(self._run(cell))
            row["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - a failed cell is data, not a crash
            oom = is_out_of_memory(exc)
            row.update(status="failed", error=("out of memory: " if oom else "") + _error_text(exc))
        if oom:  # here, not in the except block, whose traceback still holds the failed cell's tensors
            _free_accelerator_memory()
        row["wall_seconds"] = time.perf_counter() - start
        return row

    def _inject(self, cell: Cell, rule: dict[str, Any]) -> None:
        """Test hooks (``--inject-failure``): hang, allocate (on the model's device), or raise."""
        if "hang_seconds" in rule:
            time.sleep(float(rule["hang_seconds"]))
        if "allocate_mb" in rule:
            import torch

            engine = self._engine_for(cell.model)
            device = next(engine.model.parameters()).device
            block = torch.empty(int(rule["allocate_mb"]) * 1024**2, dtype=torch.uint8, device=device)
            del block
        if "message" in rule or ("allocate_mb" not in rule and "hang_seconds" not in rule):
            raise RuntimeError(rule.get("message") or f"injected failure for cell {cell.describe()}")

    def _run(self, cell: Cell) -> dict[str, Any]:
        from methods.registry import build_method
        from runner.engine.protocol import GenerationSettings, Protocol
        from runner.sample import run_sample

        engine = self._engine_for(cell.model)
        task = self._task(cell.task, cell.task_options)
        method = build_method(cell.method, cell.params)
        protocol = Protocol(**cell.protocol)
        if cell.measure == "fidelity":
            return self._run_fidelity(cell, engine, task, method, protocol)
        gen = cell.generation
        settings = GenerationSettings(
            max_new_tokens=gen["max_new_tokens"], temperature=gen["temperature"], top_p=gen["top_p"], stop=tuple(gen["stop"])
        )
        run = run_sample(engine, task, cell.sample, method, cell.budget, protocol, settings, cell.gen_seed)
        score, generation = run.score, run.generation
        return {
            "correct": bool(score.correct),
            "score": float(score.score),
            "extracted": None if score.extracted is None else str(score.extracted),
            "completion": run.completion,
            "stop_reason": generation.stop_reason,
            **_instrumentation(generation, engine),
            "details": run.details,
        }

    def _run_fidelity(self, cell: Cell, engine, task, method, protocol) -> dict[str, Any]:
        """Teacher-force the sample's reference continuation under the method and compare every scored
        token with the full cache (``runner.fidelity.measure``)."""
        from runner import fidelity

        segments = fidelity.truncate(task.fidelity_segments(cell.sample, engine.tokenizer), cell.generation["max_new_tokens"])
        key = canonical_json([self._engine_key, cell.task, cell.task_options, cell.sample_id, segments])
        shared = self._reference is not None and self._reference[0] == key
        if not shared:
            self._reference = None  # free the previous sample's before computing the next
            start = time.perf_counter()
            reference = fidelity.full_cache_logprobs(engine, segments)
            self._reference = (key, reference, time.perf_counter() - start)
        _, reference, reference_seconds = self._reference
        r = fidelity.measure(engine, segments, method, cell.budget, protocol, seed=cell.gen_seed, reference=reference)
        return {
            "measure": "fidelity",
            "kl_mean": r.kl_mean,
            "delta_nll_mean": r.delta_nll_mean,
            "top1_agreement": r.top1_agreement,
            "scored_tokens": r.tokens,
            **_instrumentation(r.generation, engine),
            "details": {"fidelity": {
                "kl_max": r.kl_max, "nll_full_mean": r.nll_full_mean, "nll_method_mean": r.nll_method_mean,
                "fed_tokens": sum(len(ids) for ids, _ in segments), "teacher_forced_seconds": r.seconds,
                # the full-cache pass: its time, and whether an earlier cell of this sample paid it
                "reference_seconds": reference_seconds, "reference_shared": shared,
            }},
        }


def _instrumentation(generation, engine) -> dict[str, Any]:
    """A cell's cost and cache figures (``GenerationResult``), the same for generation and fidelity rows,
    and the Hub commit the checkpoint was loaded from (None for a local directory)."""
    return {
        "prompt_tokens": generation.prompt_tokens,
        "generated_tokens": generation.generated_tokens,
        "prefill_seconds": generation.prefill_seconds,
        "decode_seconds_mean": generation.decode_seconds_mean,
        "decode_seconds_p50": generation.decode_seconds_p50,
        "decode_seconds_p95": generation.decode_seconds_p95,
        "tokens_per_second": generation.tokens_per_second,
        "method_seconds": generation.method_seconds,
        "evictions": generation.evictions,
        "evicted_tokens": generation.evicted_tokens,
        "peak_cache_entries": generation.peak_cache_entries,
        "peak_kv_bytes": generation.peak_kv_bytes,
        "peak_memory_bytes": generation.peak_memory_bytes,
        "peak_memory_source": generation.peak_memory_source,
        "attn_implementation": generation.attn_implementation,
        "model_revision": getattr(engine.model.config, "_commit_hash", None),
    }


def _free_accelerator_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


# ------------------------------------------------------------------------------------------------
# Progress
# ------------------------------------------------------------------------------------------------


class Progress:
    """A rich progress bar on a terminal; otherwise (a log, ``--no-progress``) a heartbeat line every
    ``every`` seconds (60 s with ``bar=False``), so a long sweep in a log is never silent."""

    def __init__(self, total: int, label: str, bar: bool = True, every: float = 10.0):
        self.total, self.label = total, label
        self.every = every if bar else max(every, 60.0)
        self.done = self.failed = 0
        self.start = time.monotonic()
        self.last_line = self.start
        self.bar = None
        if bar and sys.stdout.isatty() and total:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn

            self.bar = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("failed {task.fields[failed]}"), TimeRemainingColumn(),
            )
            self.bar.start()
            self.task_id = self.bar.add_task(label, total=total, failed=0)

    def eta(self) -> float | None:
        elapsed = time.monotonic() - self.start
        if not self.done or elapsed <= 0:
            return None
        return (self.total - self.done) * elapsed / self.done

    def line(self) -> str:
        eta = self.eta()
        eta_text = "?" if eta is None else f"{eta:.0f}s"
        rate = self.done / max(1e-9, time.monotonic() - self.start)
        return f"[{self.label}] {self.done}/{self.total} cells done, {self.failed} failed, {rate:.2f} cells/s, ETA {eta_text}"

    def update(self, done: int, failed: int) -> None:
        """Called about once a second by the dispatch loop, whether or not a cell finished."""
        self.done, self.failed = done, failed
        if self.bar is not None:
            self.bar.update(self.task_id, completed=done, failed=failed)
        elif time.monotonic() - self.last_line >= self.every:
            self.last_line = time.monotonic()
            print(self.line(), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        else:
            print(self.line(), flush=True)


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------


@dataclass
class SweepSummary:
    sweep_id: int
    total: int
    skipped: int
    ran: int
    ok: int
    failed: int
    seconds: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)


def is_loopback_address(address: str) -> bool:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


def use_loopback() -> None:
    """Keep Ray on 127.0.0.1. Without this Ray rewrites a 127.0.0.1 head address to the machine's
    network address (and binds there when starting locally); the switch is read once, when ray is
    imported, hence the module attribute too."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def _ray_exceptions():
    import ray.exceptions as rex

    died = tuple(
        getattr(rex, name) for name in ("RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError",
                                        "NodeDiedError", "ObjectLostError", "OwnerDiedError")
        if hasattr(rex, name)
    )
    return died, rex.RayTaskError


class SweepRunner:
    def __init__(
        self,
        config: SweepConfig,
        *,
        db_url: str | None = None,
        config_path: str | None = None,
        ray_address: str | None = None,
        retry_failed: bool = False,
        inject_failures: list[dict[str, Any]] | None = None,
        on_result: Callable[["SweepRunner", dict[str, Any]], None] | None = None,
        progress: bool = True,
        base_dir: Path | None = None,
        workers: int | None = None,
    ):
        self.config = config
        self.base_dir = base_dir or project_dir()
        self.db_url = db_url or config.database
        self.config_path = config_path
        self.ray_address = ray_address
        self.retry_failed = retry_failed
        self.inject_failures = inject_failures or []
        self.on_result = on_result
        self.show_progress = progress
        self.workers_override = workers
        self.actors: list[Any] = []
        self.replacements = 0
        self._started_ray = False

    # -- database -------------------------------------------------------------------------------

    def _open_db(self):
        from db.session import get_engine, upgrade

        engine = get_engine(self.db_url, self.base_dir)
        upgrade(engine)
        return engine

    # -- ray ------------------------------------------------------------------------------------

    def _init_ray(self) -> None:
        address = self.ray_address or os.environ.get("RAY_ADDRESS")
        if not address or address == "local" or is_loopback_address(address):
            use_loopback()  # before ray is imported, where possible
        if not address or address == "local":
            os.environ.setdefault("RAY_AUTH_MODE", "token")  # what Ray picks anyway, without its warning
        import ray

        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        quiet = {"logging_level": "WARNING", "log_to_driver": True}
        if address and address != "local":
            try:
                ray.init(address=address, **quiet)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise KvleagueError(f"ray: cannot connect to {address!r}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        else:
            ray.init(
                address="local",
                num_cpus=os.cpu_count() or 1,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                **quiet,
            )
        self._started_ray = True

    def _plan_workers(self, pending: int) -> tuple[int, float, float]:
        import ray

        res = self.config.resources
        resources = ray.cluster_resources()
        gpus = float(resources.get("GPU", 0))
        cpus = float(resources.get("CPU", 1))
        gpus_per = res.gpus_per_worker if res.gpus_per_worker is not None else (1.0 if gpus >= 1 else 0.0)
        if gpus_per > 0 and gpus < gpus_per:
            raise KvleagueError(f"resources.gpus_per_worker: {gpus_per} but the cluster has {gpus:g} GPUs; use 0 to run on CPUs")
        cpus_per = res.cpus_per_worker
        if cpus_per > cpus:
            raise KvleagueError(f"resources.cpus_per_worker: {cpus_per:g} but the cluster has {cpus:g} CPUs")
        if self.workers_override or res.workers:
            n = self.workers_override or res.workers
        elif gpus_per > 0:
            n = int(gpus // gpus_per)
        else:
            n = int(cpus // cpus_per)
        return max(1, min(n, pending)), cpus_per, gpus_per

    def _actor_options(self, cpus_per: float, gpus_per: float) -> dict[str, Any]:
        res = self.config.resources
        env = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
        commit, dirty = getattr(self, "git", ("unknown", None))
        if commit != "unknown":  # workers may run an uploaded copy without .git
            env["KVLEAGUE_GIT_COMMIT"] = commit
            if dirty is not None:
                env["KVLEAGUE_GIT_DIRTY"] = "1" if dirty else "0"
        return {
            "num_cpus": cpus_per,
            "num_gpus": gpus_per,
            "max_restarts": res.max_restarts,
            "max_task_retries": res.max_task_retries,
            "runtime_env": {"env_vars": env} if env else None,
        }

    def _new_actor(self):
        import ray

        threads = self.config.resources.torch_threads or max(1, int(self._cpus_per))
        options = {k: v for k, v in self._options.items() if v is not None}
        # an address-space cap would break CUDA, which maps far more address space than memory
        cap = self.config.resources.memory_limit_gb if not options.get("num_gpus") else None
        return ray.remote(CellWorker).options(**options).remote(threads, self.inject_failures, cap)

    # -- run ------------------------------------------------------------------------------------

    def run(self) -> SweepSummary:
        from db import store
        from db.session import retrying
        from runner.provenance import collect_environment, resolved_git_state

        t0 = time.monotonic()
        grid = expand(self.config, self.base_dir)
        for w in grid.warnings:
            print(f"warning: {w}", file=sys.stderr, flush=True)
        engine = self._open_db()

        def db(fn: Callable[[], Any], what: str) -> Any:  # a server restarting, another driver writing: wait
            return retrying(engine, fn, what, self.config.resources.db_retry_seconds)

        dim_ids: dict[str, dict[str, int]] = {}
        for dim, rows in grid.dims.items():
            dim_ids[dim] = db(lambda: {h: store.get_or_create(engine, store.DIMENSIONS[dim], values) for h, values in rows.items()},
                              f"recording the {dim} rows")
        # an uploaded Ray working dir has no .git: then the checkout it came from tells
        commit, dirty = resolved_git_state(self.base_dir)
        self.git = (commit, dirty)
        driver_env = collect_environment(git=self.git)
        driver_env_id = db(lambda: store.environment_id(engine, driver_env), "recording the environment")
        sweep_id = db(lambda: store.start_sweep(
            engine,
            {
                "name": self.config.name, "config": {**self.config.canonical(), "database": _display(engine)},
                "config_hash": self.config.config_hash(),
                "config_path": self.config_path, "git_commit": commit, "git_dirty": dirty,
                "environment_id": driver_env_id, "ray_address": self.ray_address or os.environ.get("RAY_ADDRESS"),
                "ray_job_id": ray_job_submission_id(),
                "n_cells": len(grid.cells),
            },
        ), "recording the sweep")
        keys = [c.key for c in grid.cells]
        existing = db(lambda: store.existing_status(engine, keys), "reading which cells are done")
        pending = [c for c in grid.cells if c.key not in existing or (self.retry_failed and existing[c.key] == "failed")]
        skipped = len(grid.cells) - len(pending)
        print(
            f"sweep {self.config.name} (#{sweep_id}): {len(grid.cells)} cells, {skipped} already in "
            f"{_display(engine)}, {len(pending)} to run",
            flush=True,
        )
        ok = failed = 0
        status = "crashed"
        try:
            if pending:
                ok, failed = self._dispatch(engine, sweep_id, pending, dim_ids)
            status = "finished"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            try:
                retrying(engine, lambda: store.finish_sweep(engine, sweep_id, status, n_skipped=skipped, n_ok=ok, n_failed=failed),
                         f"marking sweep #{sweep_id} {status}", min(30.0, self.config.resources.db_retry_seconds))
            except KvleagueError as exc:  # the results are what matters; they are written (or said not to be)
                print(f"warning: {exc}", file=sys.stderr, flush=True)
            self._shutdown()
        summary = SweepSummary(
            sweep_id=sweep_id, total=len(grid.cells), skipped=skipped, ran=len(pending), ok=ok, failed=failed,
            seconds=time.monotonic() - t0, keys=keys,
        )
        summary.rows = db(lambda: store.summary(engine, keys), "reading the summary")
        return summary

    def _shutdown(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.actors = []
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    def _dispatch(self, engine, sweep_id: int, pending: list[Cell], dim_ids: dict[str, dict[str, int]]) -> tuple[int, int]:
        self._init_ray()  # first: it sets the environment Ray reads once, at import
        import ray
        from sqlalchemy.exc import SQLAlchemyError

        from db import store
        from db.session import error_reason, retrying, transient

        died_errors, task_error = _ray_exceptions()
        res = self.config.resources
        n_workers, self._cpus_per, gpus_per = self._plan_workers(len(pending))
        self._options = self._actor_options(self._cpus_per, gpus_per)
        self.actors = [self._new_actor() for _ in range(n_workers)]
        # a ping per new actor: the cell time limit counts from when it is up (not while Ray starts
        # the process and imports torch)
        starting: list[Any] = [actor.ping.remote() for actor in self.actors]
        print(f"workers: {n_workers} actor(s), {self._cpus_per:g} CPU / {gpus_per:g} GPU each", flush=True)
        if res.memory_limit_gb and gpus_per:
            print("warning: resources.memory_limit_gb applies to CPU workers only; GPU workers run without it "
                  "(CUDA out of memory is still a failed row)", file=sys.stderr, flush=True)

        queue: collections.deque[Cell] = collections.deque(pending)
        inflight: dict[Any, tuple[int, Cell | None]] = {}  # ref -> (actor slot, cell; None for a ping)
        # per slot, its cells' refs in the order the actor runs them (one at a time): the first is
        # running, since about when the one before it ended
        running: list[collections.deque] = [collections.deque() for _ in range(n_workers)]
        since = [0.0] * n_workers
        load = [0] * n_workers
        probing = [False] * n_workers
        env_ids: dict[str, int] = {}
        revisions_known: set[int] = set()
        buffer: list[dict[str, Any]] = []
        last_flush = time.monotonic()
        lost_since: float | None = None  # when a write first failed for a lost database
        retry_at, backoff = 0.0, 0.5
        done = ok = failed = 0
        progress = Progress(len(pending), self.config.name, bar=self.show_progress)
        max_replacements = 2 * n_workers + 2

        def record(cell: Cell, row: dict[str, Any]) -> None:
            nonlocal done, ok, failed
            row.update(
                sweep_id=sweep_id, budget=cell.budget, sample_id=cell.sample_id, sample_index=cell.sample_index,
                seed=cell.seed, attempts=cell.attempts, measure=cell.measure,
                **{f"{dim}_id": dim_ids[dim][h] for dim, h in cell.dims.items() if dim != "method"},
                method_spec_id=dim_ids["method"][cell.dims["method"]],
            )
            buffer.append(row)
            done += 1
            if row["status"] == "ok":
                ok += 1
            else:
                failed += 1
            if self.on_result is not None:
                self.on_result(self, row)

        def write(rows: list[dict[str, Any]]) -> None:
            """Workers' environments, model revisions, then the results: every step idempotent, so
            the whole is retried after a lost connection."""
            out = []
            for row in rows:
                row = dict(row)
                env = row.pop("environment", None)
                if env is not None:
                    if env["spec_hash"] not in env_ids:
                        env_ids[env["spec_hash"]] = store.environment_id(engine, env)
                    row["environment_id"] = env_ids[env["spec_hash"]]
                revision = row.pop("model_revision", None)
                if revision and row["model_id"] not in revisions_known:
                    store.set_model_revision(engine, row["model_id"], str(revision))
                    revisions_known.add(row["model_id"])
                out.append(row)
            store.write_results(engine, out, replace_failed=self.retry_failed)

        def flush(force: bool = False) -> None:
            """Write the buffer when due. A lost database does not stop the sweep: its results stay
            in the buffer and the write is retried with backoff, up to ``db_retry_seconds``."""
            nonlocal last_flush, lost_since, retry_at, backoff
            now = time.monotonic()
            if not buffer or not force and (now < retry_at or len(buffer) < res.batch_size and now - last_flush < res.flush_seconds):
                return
            if force:
                left = res.db_retry_seconds - (now - lost_since if lost_since is not None else 0.0)
                try:
                    retrying(engine, lambda: write(buffer), f"writing {len(buffer)} finished results", max(left, 1.0))
                except KvleagueError as exc:
                    raise KvleagueError(f"{exc}; run the same command again to resume") from None
            else:
                try:
                    write(buffer)
                except SQLAlchemyError as exc:
                    if not transient(exc):
                        raise
                    lost_since = now if lost_since is None else lost_since
                    if now - lost_since >= res.db_retry_seconds:
                        buffer.clear()  # said below; the forced flush on the way out must not wait again
                        raise KvleagueError(
                            f"database: {_display(engine)} lost for {now - lost_since:.0f}s ({error_reason(exc)}); "
                            f"{len(buffer)} finished results not written: run the same command again to resume") from None
                    print(f"database: cannot write {len(buffer)} finished results ({error_reason(exc)}); keeping them, "
                          f"retrying in {backoff:g}s", file=sys.stderr, flush=True)
                    retry_at, backoff = now + backoff, min(2 * backoff, 30.0)
                    return
            if lost_since is not None:
                print(f"database: back after {time.monotonic() - lost_since:.0f}s; wrote {len(buffer)} results", file=sys.stderr, flush=True)
            buffer.clear()
            last_flush, lost_since, retry_at, backoff = time.monotonic(), None, 0.0, 0.5

        def finished(slot: int, ref: Any) -> None:
            if ref in running[slot]:
                running[slot].remove(ref)
                since[slot] = time.monotonic()

        def worker_lost(slot: int, cell: Cell | None, exc: BaseException) -> None:
            if cell is not None:
                cell.attempts += 1
                if cell.attempts >= res.max_cell_attempts:
                    record(cell, {"cell_key": cell.key, "status": "failed",
                                  "error": f"worker died {cell.attempts} times running this cell; last: {_error_text(exc)}"})
                else:
                    queue.appendleft(cell)
            if not probing[slot]:  # is the actor restarting, or gone for good?
                probing[slot] = True
                inflight[self.actors[slot].ping.remote()] = (slot, None)
                load[slot] += 1

        def timed_out(slot: int) -> None:
            """The slot's running cell is over its time: a failed row; the actor is killed (a hung
            call cannot be cancelled: Ray cancels only queued actor calls) and replaced, and the
            cells queued behind the hung one go back to the queue."""
            cell = inflight[running[slot][0]][1]
            cell.attempts += 1
            record(cell, {"cell_key": cell.key, "status": "failed", "error": (
                f"timed out after {res.cell_timeout_seconds:g}s (resources.cell_timeout_seconds); its worker was replaced")})
            ray.kill(self.actors[slot], no_restart=True)
            for ref in [r for r, (s, _) in inflight.items() if s == slot]:
                other = inflight.pop(ref)[1]
                if other is not None and other is not cell:
                    queue.appendleft(other)
            running[slot].clear()
            load[slot], probing[slot] = 0, False
            self.actors[slot] = self._new_actor()
            starting[slot] = self.actors[slot].ping.remote()
            print(f"worker {slot}: {cell.describe()} timed out after {res.cell_timeout_seconds:g}s; replaced the worker",
                  file=sys.stderr, flush=True)

        try:
            while queue or inflight:
                for slot in range(n_workers):
                    while queue and not probing[slot] and load[slot] < res.in_flight_per_worker:
                        cell = queue.popleft()
                        ref = self.actors[slot].run.remote(cell)
                        inflight[ref] = (slot, cell)
                        if not running[slot]:
                            since[slot] = time.monotonic()
                        running[slot].append(ref)
                        load[slot] += 1
                if not inflight:
                    if all(probing):
                        raise KvleagueError("ray: every worker is gone and none can be replaced")
                    continue
                ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
                rest = [r for r in inflight if r not in ready]
                if ready and rest:
                    more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                    ready += more
                for ref in ready:
                    slot, cell = inflight.pop(ref)
                    load[slot] -= 1
                    finished(slot, ref)
                    try:
                        out = ray.get(ref)
                    except died_errors as exc:
                        if cell is None:  # the ping failed: the actor is dead for good; replace it
                            if self.replacements >= max_replacements:
                                raise KvleagueError(f"ray: workers keep dying ({self.replacements} replaced); last: {_error_text(exc)}") from None
                            self.replacements += 1
                            self.actors[slot] = self._new_actor()
                            starting[slot] = self.actors[slot].ping.remote()
                            probing[slot] = False
                            print(f"worker {slot} died; replaced it ({self.replacements}/{max_replacements})", file=sys.stderr, flush=True)
                        else:
                            worker_lost(slot, cell, exc)
                        continue
                    except task_error as exc:  # run() catches cell errors, so this is the worker itself
                        if cell is None:
                            probing[slot] = False
                        else:
                            record(cell, {"cell_key": cell.key, "status": "failed", "error": _error_text(exc)})
                        continue
                    if cell is None:
                        probing[slot] = False  # the restarted actor answers
                        continue
                    cell.attempts += 1
                    record(cell, out)
                if res.cell_timeout_seconds:
                    now = time.monotonic()
                    for slot in range(n_workers):
                        if starting[slot] is not None:
                            if not ray.wait([starting[slot]], timeout=0)[0]:
                                continue
                            starting[slot], since[slot] = None, max(since[slot], now)
                        if running[slot] and now - since[slot] > res.cell_timeout_seconds:
                            timed_out(slot)
                flush()
                progress.update(done, failed)
        finally:
            flush(force=True)
            progress.close()
        return ok, failed


def ray_job_submission_id() -> str | None:
    """The Ray Jobs submission id when this driver runs as a Ray job."""
    import json

    text = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if text:
        try:
            found = json.loads(text).get("metadata", {}).get("job_submission_id")
            if found:
                return str(found)
        except (ValueError, AttributeError):
            pass
    return os.environ.get("RAY_JOB_SUBMISSION_ID")


def _display(engine) -> str:
    from db.session import display_url

    return display_url(engine.url)


def print_summary(summary: SweepSummary, file=None) -> None:
    out = file or sys.stdout
    print(
        f"sweep #{summary.sweep_id}: {summary.total} cells ({summary.skipped} already done, {summary.ran} run: "
        f"{summary.ok} ok, {summary.failed} failed) in {summary.seconds:.1f}s",
        file=out,
    )
    if not summary.rows:
        return
    header = f"{'model':<18} {'task':<28} {'method':<16} {'budget':>7} {'cells':>6} {'ok':>5} {'failed':>6} {'score':>7}"
    print(header, file=out)
    variants: dict[str, set] = collections.defaultdict(set)
    task_options: dict[str, list[dict]] = collections.defaultdict(list)
    for r in summary.rows:
        variants[r["method"]].add(r["params"])
        if r["task_options"] not in task_options[r["task"]]:
            task_options[r["task"]].append(r["task_options"])
    for r in summary.rows:
        score = "-" if r["mean_score"] is None else f"{r['mean_score']:.3f}"
        method = r["method"] if len(variants[r["method"]]) == 1 else f"{r['method']}{r['params']}"
        task = r["task"] + _distinguishing(r["task_options"], task_options[r["task"]])
        # a fidelity row has no score: its mean KL to the full cache and top-1 agreement instead
        fidelity = "" if r.get("mean_kl") is None else f"  fidelity: KL {r['mean_kl']:.4f}, top-1 {100 * r['mean_top1']:.1f}%"
        print(f"{r['model'][:18]:<18} {task[:28]:<28} {method[:16]:<16} {r['budget']:>7} {r['cells']:>6} {r['ok']:>5} {r['failed']:>6} {score:>7}{fidelity}", file=out)


def _distinguishing(options: dict, siblings: list[dict]) -> str:
    """``[k=v,...]`` for the options in which a task spec differs from same-named ones ("" if alone)."""
    if len(siblings) < 2:
        return ""
    keys = sorted({k for o in siblings for k in o if len({json.dumps(x.get(k), sort_keys=True) for x in siblings}) > 1})
    return "[" + ",".join(f"{k}={options.get(k)}" for k in keys) + "]"


# ------------------------------------------------------------------------------------------------
# Command line (shared by ``python runner/sweep.py`` and ``kvleague sweep``)
# ------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="sweep YAML (see sweeps/demo.yaml)")
    p.add_argument("--db", default=None, help="database URL (overrides the config's database)")
    p.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS, else a local Ray on 127.0.0.1)")
    p.add_argument("--workers", type=int, default=None, help="number of actors (overrides resources.workers)")
    p.add_argument("--limit", type=int, default=None, help="cap every task's sample limit (quick runs)")
    p.add_argument("--retry-failed", action="store_true", help="run cells stored as failed again")
    p.add_argument("--dry-run", action="store_true", help="validate and count cells; run nothing, write nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar; a heartbeat line every 60 s instead")
    p.add_argument("--inject-failure", action="append", default=[], metavar="JSON", help=argparse.SUPPRESS)


def run_from_args(args: argparse.Namespace) -> int:
    import json

    from db.session import parse_url

    base = project_dir()
    if args.workers is not None and args.workers < 1:
        raise KvleagueError(f"--workers: must be >= 1, got {args.workers}")
    if args.limit is not None and args.limit < 1:
        raise KvleagueError(f"--limit: must be >= 1, got {args.limit}")
    config = load_config(args.config, check=False, base_dir=base)
    if args.limit is not None:
        for t in config.tasks:
            t.limit = min(t.limit, args.limit) if t.limit else args.limit
    if args.db:
        parse_url(args.db, base)
    try:
        check_config(config, base)
    except KvleagueError as exc:
        raise KvleagueError(clip(f"config {args.config}: {exc}")) from None
    injections = []
    for text in args.inject_failure:
        try:
            rule = json.loads(text)
        except ValueError:
            raise KvleagueError(f"--inject-failure: not JSON: {text!r}") from None
        if not isinstance(rule, dict):
            raise KvleagueError("--inject-failure: expected a JSON object of cell fields")
        injections.append(rule)
    if args.dry_run:
        grid = expand(config, base)
        for w in grid.warnings:
            print(f"warning: {w}", file=sys.stderr)
        print(f"sweep {config.name}: {len(grid.cells)} cells (dry run; nothing written)")
        return 0
    runner = SweepRunner(
        config, db_url=args.db, config_path=str(args.config), ray_address=args.address, retry_failed=args.retry_failed,
        inject_failures=injections, progress=not args.no_progress, base_dir=base, workers=args.workers,
    )
    summary = runner.run()
    print_summary(summary)
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise KvleagueError(f"{self.prog}: {message}")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = _Parser(prog="runner/sweep.py", description="Run a kvleague sweep on Ray; results go to SQL.")
    add_arguments(parser)
    try:
        return run_from_args(parser.parse_args(argv))
    except KvleagueError as exc:
        print(f"kvleague: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvleague: interrupted; finished cells are saved, run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
