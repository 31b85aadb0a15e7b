"""The measuring harness shared by the systems benchmarks (``kvleague bench ...``).

* :func:`environment`: where a figure was measured (CPU model and cores, GPU, library versions, git
  commit), recorded in every report;
* :class:`Clock` and :func:`alternate`: compared runs interleave round-robin in one process (so
  load from other tenants hits them alike), and medians are compared; the ``cpu`` clock is the
  process CPU time with one torch thread, robust to a shared machine;
* :func:`search_limit`: the largest size a monotone yes/no probe accepts (cap first, then doubling,
  then bisection);
* :func:`make_report` / :func:`validate_report` / :func:`write_report`: one JSON layout for every
  benchmark: wide ``rows`` to read, and long ``figures`` (one number each, with its unit, method,
  budget and reference) that ``--store`` writes to the database unchanged;
* :func:`across_backends`: one benchmark on each engine backend of ``--backend`` in one run, the
  figures tagged with their backend and the backends' tokens/s ratios added;
* :func:`load_engine`: a benchmark's model, loaded once per process behind each backend asked for;
* :func:`default_model`: the offline CPU model (a random-weight llama of 41M parameters).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
import uuid
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from kvleague.engine.errors import KvleagueError

K = TypeVar("K", bound=Hashable)

SCHEMA_VERSION = 1
BENCHMARKS = (
    "feasible_context",
    "decode_speed",
    "vs_kvpress",
    "engine_vs_generate",
    "batch",
    "refill",
    "episodes",
    "device_busy",
)
ENVIRONMENT_KEYS = (
    "cpu_model",
    "cpu_count",
    "cpu_affinity",
    "torch_threads",
    "gpu_name",
    "gpu_count",
    "cuda_version",
    "python_version",
    "torch_version",
    "transformers_version",
    "kvpress_version",
    "kvleague_version",
    "git_commit",
    "git_dirty",
    "platform",
    "hostname",
    "load_average",
    "spec_hash",
)
FIGURE_KEYS = {
    "metric": str,
    "value": (int, float, type(None)),
    "unit": str,
    "method": (str, type(None)),
    "budget": (int, type(None)),
    "reference": (str, type(None)),
    "details": dict,
}

#: the default CPU model: 8 layers, hidden 768, 12 query / 4 KV heads of 64 (41M parameters)
DEFAULT_ARCH = dict(arch="llama", layers=8, hidden=768, heads=12, kv_heads=4)


# -- environment ----------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, Any]:
    """Facts about this process's machine and code. Every value is read, never assumed.

    A superset of :func:`runner.provenance.collect_environment` (so ``--store`` links the figures
    to an ``environments`` row) with the CPU model, usable cores, torch threads and the load."""
    import torch

    from kvleague.runner.provenance import collect_environment

    env = collect_environment()
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 0
    env.update(
        cpu_model=_cpu_model(),
        cpu_count=os.cpu_count() or 0,
        cpu_affinity=affinity,
        torch_threads=torch.get_num_threads(),
        kvpress_version=_version("kvpress"),
        load_average=[round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else [],
    )
    return env


# -- clocks and alternating runs ------------------------------------------------------------------


#: ``auto``: ``cpu`` on a machine without CUDA, else ``wall``
CLOCKS = ("auto", "cpu", "wall")


class Clock:
    """``cpu``: process CPU time (pair with one torch thread); ``wall``: ``time.perf_counter`` after
    waiting for queued GPU work (CUDA runs asynchronously). The CPU clock cannot see GPU work, so it
    is refused where CUDA is available."""

    def __init__(self, kind: str = "auto"):
        if kind not in CLOCKS:
            raise ValueError(f"clock: unknown {kind!r}; allowed: {', '.join(CLOCKS)}")
        import torch

        if kind == "auto":  # the CPU clock where it can be used: robust to other tenants' load
            kind = "wall" if torch.cuda.is_available() else "cpu"
        if kind == "cpu" and torch.cuda.is_available():
            raise KvleagueError("clock: cpu time does not count GPU work; use --clock wall on a CUDA machine")
        self.kind = kind
        if kind == "cpu":
            self.now = time.process_time
        else:  # the engine's own clock: one definition of "wait for the device, then read"
            from kvleague.engine.resources import device_clock

            self.now = device_clock(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def set_threads(clock: Clock, threads: int | None) -> int:
    """Torch threads for a run: ``threads`` if given, else 1 under the CPU clock (else torch's default)."""
    import torch

    if threads or clock.kind == "cpu":
        torch.set_num_threads(threads or 1)
    return torch.get_num_threads()


def alternate(runs: Mapping[K, Callable[[], Any]], rounds: int, warmup: int = 1) -> dict[K, list[Any]]:
    """Call every run once per round, round-robin, the starting run rotating; return results per run.

    ``warmup`` rounds run first and are discarded (allocator, kernels, caches)."""
    names = list(runs)
    for _ in range(warmup):
        for name in names:
            runs[name]()
    out: dict[K, list[Any]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out[name].append(runs[name]())
    return out


def median(values: Iterable[float]) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else math.nan


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


# -- the limit search -----------------------------------------------------------------------------


@dataclass
class Probe:
    size: int
    fits: bool
    detail: dict = field(default_factory=dict)


@dataclass
class SearchResult:
    """``limit``: the largest size known to fit (0 if none did); ``capped``: the cap itself fit, so
    the true limit is at least ``limit`` (= the cap); ``upper``: the smallest size known not to fit."""

    limit: int
    capped: bool
    upper: int | None
    probes: list[Probe]

    def to_dict(self) -> dict:
        return asdict(self)


def search_limit(
    probe: Callable[[int], bool | tuple[bool, dict]],
    *,
    start: int,
    cap: int,
    resolution: int = 1,
    relative: float = 0.0,
    cap_first: bool = True,
) -> SearchResult:
    """The largest size in ``[1, cap]`` that ``probe`` accepts, assuming acceptance is monotone.

    Try ``cap`` first (``cap_first``: one probe settles a method that fits everything); else double
    from ``start`` until a probe fails or the cap is reached, then bisect between the last fit and
    the first failure until they are at most ``max(resolution, relative * fit)`` apart. With
    ``resolution=1`` and ``relative=0`` the exact limit is found.
    """
    if start < 1 or cap < 1:
        raise ValueError("search_limit: start and cap must be >= 1")
    probes: list[Probe] = []

    def run(size: int) -> bool:
        out = probe(size)
        fits, detail = (out, {}) if isinstance(out, bool) else out
        probes.append(Probe(size, bool(fits), dict(detail)))
        return bool(fits)

    lo, hi = 0, None  # lo fits (0 trivially), hi does not
    if cap_first:
        if run(cap):
            return SearchResult(cap, True, None, probes)
        hi = cap
    size = min(start, cap)
    while hi is None or size < hi:
        if run(size):
            lo = size
            if size >= cap:
                return SearchResult(cap, True, None, probes)
            size = min(size * 2, cap)
        else:
            hi = size
            break
    if hi is None:
        hi = cap
    while hi - lo > max(resolution, int(relative * lo)):
        mid = (lo + hi) // 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(lo, False, hi, probes)


# -- reports ---------------------------------------------------------------------------------------


def figure(
    metric: str,
    value: float | int | None,
    unit: str,
    *,
    method: str | None = None,
    budget: int | None = None,
    reference: str | None = None,
    **details: Any,
) -> dict[str, Any]:
    """One stored number. ``reference``: what a ratio is relative to; ``details``: anything else."""
    if isinstance(value, float) and math.isnan(value):
        value = None
    return {
        "metric": metric,
        "value": value,
        "unit": unit,
        "method": method,
        "budget": budget,
        "reference": reference,
        "details": details,
    }


def make_report(
    benchmark: str,
    *,
    config: dict[str, Any],
    rows: list[dict[str, Any]],
    figures: list[dict[str, Any]],
    summary: dict[str, Any],
    env: dict[str, Any] | None = None,
    started: float | None = None,
) -> dict[str, Any]:
    report = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": benchmark,
        "run_id": uuid.uuid4().hex,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_seconds": None if started is None else round(time.perf_counter() - started, 1),
        "environment": env if env is not None else environment(),
        "config": config,
        "rows": rows,
        "figures": figures,
        "summary": summary,
    }
    validate_report(report)
    return report


def across_backends(args, run_one: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """``run_one(args)`` once per backend of ``args.backend`` (``--backend``, default ``hf``), each run
    given its backend as ``args.backend``. Every row and figure is tagged with its backend. With one
    backend that is its report; with several, one report holds them all (rows and figures in turn,
    ``summary.by_backend``) plus a ``backend_speed_ratio`` figure for every tokens/s figure of a later
    backend over the same figure (metric, method, budget, details) of the first."""
    import argparse

    backends = list(dict.fromkeys(getattr(args, "backend", None) or ["hf"]))
    reports = []
    for backend in backends:
        sub = argparse.Namespace(**vars(args))
        sub.backend = backend
        report = run_one(sub)
        report["config"]["backend"] = backend
        for row in report["rows"]:
            row["backend"] = backend
        for fig in report["figures"]:
            fig["details"]["backend"] = backend
        reports.append(report)
    if len(reports) == 1:
        return reports[0]
    first = reports[0]

    def key(fig: dict) -> tuple:
        details = {k: v for k, v in fig["details"].items() if k != "backend"}
        return (
            fig["metric"],
            fig["method"],
            fig["budget"],
            fig["reference"],
            json.dumps(details, sort_keys=True, default=str),
        )

    reference = {key(f): f for f in first["figures"] if f["unit"] == "tokens/s"}
    ratios, extra = [], []
    for backend, report in zip(backends[1:], reports[1:]):
        for fig in report["figures"]:
            base = reference.get(key(fig)) if fig["unit"] == "tokens/s" else None
            if base is None:
                continue
            value = ratio(fig["value"], base["value"])
            which = ", ".join(f"{k} {v}" for k, v in fig["details"].items() if k in ("runner", "batch_size"))
            ratios.append(
                {
                    "backend": backend,
                    "reference": backends[0],
                    "metric": fig["metric"],
                    "method": fig["method"],
                    "budget": fig["budget"],
                    "which": which,
                    "ratio": value,
                }
            )
            extra.append(
                figure(
                    "backend_speed_ratio",
                    value,
                    "x",
                    method=fig["method"],
                    budget=fig["budget"],
                    reference=f"backend {backends[0]}",
                    of=fig["metric"],
                    **{k: v for k, v in fig["details"].items()},
                )
            )
    config = {**first["config"], "backend": None, "backends": backends}
    merged = make_report(
        first["benchmark"],
        config=config,
        rows=[row for r in reports for row in r["rows"]],
        figures=[f for r in reports for f in r["figures"]] + extra,
        summary={
            "backends": backends,
            "by_backend": {b: r["summary"] for b, r in zip(backends, reports)},
            "backend_ratios": ratios,
        },
        env=first["environment"],
    )
    merged["elapsed_seconds"] = sum(r["elapsed_seconds"] or 0 for r in reports)
    print(f"\nbackends side by side: tokens/s of {', '.join(backends[1:])} over {backends[0]}")
    print(
        table(
            ratios,
            [
                ("backend", "backend", ""),
                ("metric", "figure", ""),
                ("method", "method", ""),
                ("budget", "budget", ""),
                ("which", "", ""),
                ("ratio", "ratio", ".3f"),
            ],
        )
    )
    return merged


def validate_report(report: Any) -> None:
    """Raise ``ValueError`` listing every way ``report`` departs from the report schema."""
    problems: list[str] = []
    if not isinstance(report, dict):
        raise ValueError("report: not a JSON object")
    expected = {
        "schema_version": int,
        "benchmark": str,
        "run_id": str,
        "created_at": str,
        "environment": dict,
        "config": dict,
        "rows": list,
        "figures": list,
        "summary": dict,
    }
    for key, kind in expected.items():
        if not isinstance(report.get(key), kind):
            problems.append(f"{key}: expected {kind.__name__}, got {type(report.get(key)).__name__}")
    if report.get("schema_version") not in (None, SCHEMA_VERSION) and isinstance(report.get("schema_version"), int):
        problems.append(f"schema_version: {report['schema_version']} is not {SCHEMA_VERSION}")
    if isinstance(report.get("benchmark"), str) and report["benchmark"] not in BENCHMARKS:
        problems.append(f"benchmark: unknown {report['benchmark']!r}; allowed: {', '.join(BENCHMARKS)}")
    if isinstance(report.get("environment"), dict):
        missing = [k for k in ENVIRONMENT_KEYS if k not in report["environment"]]
        if missing:
            problems.append(f"environment: missing {', '.join(missing)}")
    for i, row in enumerate(report.get("rows") or []):
        if not isinstance(row, dict):
            problems.append(f"rows[{i}]: not an object")
    for i, fig in enumerate(report.get("figures") or []):
        if not isinstance(fig, dict):
            problems.append(f"figures[{i}]: not an object")
            continue
        for key, kind in FIGURE_KEYS.items():
            if key not in fig:
                problems.append(f"figures[{i}]: missing {key}")
            elif not isinstance(fig[key], kind) or isinstance(fig[key], bool):
                problems.append(f"figures[{i}].{key}: unexpected type {type(fig[key]).__name__}")
        extra = set(fig) - set(FIGURE_KEYS)
        if extra:
            problems.append(f"figures[{i}]: unknown keys {', '.join(sorted(extra))}")
        value = fig.get("value")
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"figures[{i}].value: not finite")
    try:
        json.dumps(report, allow_nan=False)
    except (TypeError, ValueError) as exc:
        problems.append(f"not JSON-serialisable: {exc}")
    if problems:
        raise ValueError("report: " + "; ".join(problems))


def write_report(report: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    validate_report(report)
    path = Path(path)
    if path.parent and not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return path


def read_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    report = json.loads(Path(path).read_text())
    validate_report(report)
    return report


# -- tables ----------------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]], key: dict[str, str] | None = None) -> str:
    """Plain-text table; ``columns``: (key, header, format spec, e.g. ``".2f"``). Missing -> ``-``.
    ``key``: header -> what the column is, one line each under the table."""

    def cell(row, key, spec):
        value = row.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return format(value, spec) if spec else str(value)

    body = [[cell(r, k, s) for k, _, s in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, (_, h, _) in enumerate(columns)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, ((_, h, _), w) in enumerate(zip(columns, widths)))]
    lines.append("-" * len(lines[0]))
    for b in body:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(b, widths))))
    lines += [f"  {header}: {text}" for header, text in (key or {}).items()]
    return "\n".join(lines)


def describe_environment(env: dict[str, Any]) -> str:
    gpu = f", GPU {env['gpu_name']}" if env.get("gpu_count") else ", no GPU"
    return (
        f"{env['cpu_model']} ({env['cpu_affinity']} of {env['cpu_count']} cores usable{gpu}), torch {env['torch_version']}, "
        f"transformers {env['transformers_version']}, git {str(env['git_commit'])[:12]}{'+dirty' if env.get('git_dirty') else ''}, "
        f"load average {', '.join(f'{x:.1f}' for x in env.get('load_average') or [])}"
    )


# -- the default model -----------------------------------------------------------------------------


def default_model(root: str | os.PathLike[str] | None = None, **overrides: Any) -> Path:
    """A random-weight checkpoint built offline (cached by shape under ``root``, default a temp dir)."""
    import tempfile

    from kvleague.runner.models.tiny import make_tiny_model

    spec = {**DEFAULT_ARCH, **overrides}
    root = Path(
        root or os.environ.get("KVLEAGUE_BENCH_MODELS") or Path(tempfile.gettempdir()) / "kvleague-bench-models"
    )
    name = f"{spec['arch']}-l{spec['layers']}-h{spec['hidden']}-q{spec['heads']}-kv{spec['kv_heads']}"
    path = root / name
    if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
        tmp = root / f".{name}.{os.getpid()}"
        make_tiny_model(
            spec["arch"],
            tmp,
            layers=spec["layers"],
            hidden=spec["hidden"],
            heads=spec["heads"],
            kv_heads=spec["kv_heads"],
        )
        try:
            tmp.rename(path)
        except OSError:  # another process built it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path


#: the last model a benchmark loaded: (source, engine)
_LOADED: tuple[str, Any] | None = None


def load_engine(source: str, backend: str):
    """``source``'s model behind ``backend``, loaded once per process: the backends of one run
    (``--backend hf --backend slab``) share one model object, and whatever was compiled for it
    (``model.generate``'s static-cache anchor) is compiled once."""
    global _LOADED
    from kvleague.runner.models import load_engine as load

    if _LOADED is not None and _LOADED[0] == source:
        return _LOADED[1].with_backend(backend)
    engine = load(source, backend=backend)
    _LOADED = (source, engine)
    return engine


def bench_engine(args) -> tuple[str, Any, str]:
    """A benchmark's model (``--model``, else the default) behind ``args.backend`` with no EOS (every
    run decodes exactly its number of tokens): ``(source, engine, label)``."""
    source = str(args.model or default_model())
    engine = load_engine(source, args.backend)
    engine.eos_ids = set()
    return source, engine, model_label(engine, args.model)


def model_label(engine, source: str | None) -> str:
    about = engine.describe()
    params = about["parameters"]
    shape = (
        f"{about['model_type']}, {engine.n_layers} layers, hidden {engine.backend.hidden_size}, "
        f"{engine.n_heads}/{engine.n_kv_heads} heads, {params / 1e6:.1f}M params"
    )
    return f"{source} ({shape})" if source else f"random-weight {shape}"


def random_prompt(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    """``n`` token ids drawn uniformly from the byte range (valid in every kvleague tokenizer)."""
    import torch

    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
