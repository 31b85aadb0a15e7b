"""The fast GPU backend's targets, read from a ``scripts/gpu_check.sh`` folder: one table of what was
measured against what was asked, each figure beside the memory-bandwidth bound of the GPU it ran on.

``kvleague bench targets DIR`` reads the reports the check wrote (``generate.json``, ``batch.json``,
``batch-attention.json``, ``static32.json``) and writes ``DIR/targets.md`` and ``DIR/targets.json``.
Every value is copied from a report, never recomputed or filled in: a step that did not run, failed,
or lacks the figure reads "not measured"; a figure from a CPU run, at other settings than the
target's, or against an uncompiled anchor is shown and not judged.

The bound: a decode step at batch ``b`` reads every weight once, so no backend decodes faster than
``b x bandwidth / weight_bytes`` tokens/s. ``bandwidth`` is a device-to-device copy (bytes read +
written per second) that the check measures first, on its GPU, into ``DIR/bandwidth.json`` (so the
table can be rebuilt anywhere from the folder, even from a check cut short); ``weight_bytes`` is the
reports' own model (``summary.engine``: parameters x the dtype's bytes). Reading the KV cache lowers
the true bound at large batches, so a share of it is an upper estimate of how well the GPU is used.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvleague.engine.errors import KvleagueError

#: the reports ``scripts/gpu_check.sh`` writes that the targets read, by step
REPORTS = ("generate", "batch", "batch-attention", "static32")
#: its profile of the decode steps (``bench busy``), shown beside the targets (not one of them)
BUSY = "busy"
#: bytes per parameter of the dtypes a report's engine may run in
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Target:
    """One row of the fast-backend issue's targets table and the figure of a report it reads."""

    label: str
    report: str  # file stem in the check's folder
    metric: str
    method: str
    target: float
    batch_size: int | None = None  # None: a figure without batch size (``bench generate``)
    reference: str | None = None
    #: batch size of a tokens/s figure, for its bound (None: a ratio, which has no bound)
    decode_batch: int | None = None
    #: the issue's settings; a figure run at others is shown, not judged
    settings: tuple[tuple[str, int], ...] = ()


GENERATE = (("prompt_tokens", 1024), ("new_tokens", 256))
BATCH = (("prompt_tokens", 400), ("new_tokens", 64), ("budget", 200))
TARGETS = (
    Target(
        "batch 1, `full`, prompt 1024, 256 new (tok/s)",
        "generate",
        "decode_tokens_per_second",
        "engine",
        400,
        decode_batch=1,
        settings=GENERATE,
    ),
    Target(
        "batch 1, `epikv`, B = 200 (tok/s)",
        "batch",
        "decode_tokens_per_second",
        "epikv",
        400,
        batch_size=1,
        decode_batch=1,
        settings=BATCH,
    ),
    Target(
        "batch 32, `full`, prompt 400, B = 200 (tok/s)",
        "batch",
        "decode_tokens_per_second",
        "full",
        4000,
        batch_size=32,
        decode_batch=32,
        settings=BATCH,
    ),
    Target(
        "batch 32, `epikv` (tok/s)",
        "batch",
        "decode_tokens_per_second",
        "epikv",
        4000,
        batch_size=32,
        decode_batch=32,
        settings=BATCH,
    ),
    Target(
        "batch 32, `snapkv` (tok/s)",
        "batch-attention",
        "decode_tokens_per_second",
        "snapkv",
        1500,
        batch_size=32,
        decode_batch=32,
        settings=BATCH,
    ),
    Target(
        "batch 32, `h2o` (tok/s)",
        "batch-attention",
        "decode_tokens_per_second",
        "h2o",
        1500,
        batch_size=32,
        decode_batch=32,
        settings=BATCH,
    ),
    Target(
        "`full` / `model.generate` (static cache + compile), batch 1",
        "generate",
        "speed_ratio",
        "engine",
        0.9,
        reference="generate_static",
        settings=GENERATE,
    ),
    Target(
        "`full` / `model.generate` (static cache + compile), batch 32",
        "static32",
        "speed_ratio",
        "engine",
        0.9,
        batch_size=32,
        reference="generate_static",
        settings=BATCH,
    ),
    Target(
        "first pass over new KV lengths / second pass",
        "generate",
        "first_pass_ratio",
        "engine",
        0.95,
        reference="second pass",
        settings=GENERATE,
    ),
)
BACKENDS = ("hf", "slab")


@dataclass
class Cell:
    """One backend's value of one target (None: not measured) and what the report says beside it."""

    value: float | None = None
    met: bool | None = None
    share_of_bound: float | None = None
    note: str = ""


def copy_bandwidth(gib: float = 1.0, repeats: int = 10) -> float | None:
    """Bytes read + written per second by a device-to-device copy on this process's CUDA device
    (CUDA events around ``repeats`` copies after three warm-ups); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * n * repeats / (start.elapsed_time(end) / 1e3)


def record_bandwidth(folder: str | Path) -> dict | None:
    """Measure :func:`copy_bandwidth` on this CUDA device into ``folder/bandwidth.json`` (the GPU
    check's first step); None without CUDA."""
    import torch

    measured = copy_bandwidth()
    if measured is None:
        return None
    record = {"bytes_per_second": measured, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    Path(folder, "bandwidth.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"device-to-device copy on {record['gpu']}: {measured / 1e12:.2f} TB/s (read + write)")
    return record


def weight_bytes(reports: dict[str, dict | None]) -> int | None:
    """The bytes of weights one decode step reads, from the engines the reports describe (None when
    none says, or when they ran different models or dtypes)."""
    seen = set()
    for report in reports.values():
        if report is None:
            continue
        summary = report["summary"]
        for about in [summary.get("engine"), *(s.get("engine") for s in summary.get("by_backend", {}).values())]:
            if about and about.get("dtype") in DTYPE_BYTES:
                seen.add(about["parameters"] * DTYPE_BYTES[about["dtype"]])
    return seen.pop() if len(seen) == 1 else None


def _figure(report: dict, t: Target, backend: str) -> dict | None:
    for fig in report["figures"]:
        d = fig["details"]
        if (
            fig["metric"] == t.metric
            and fig["method"] == t.method
            and fig["reference"] == t.reference
            and d.get("batch_size") == t.batch_size
            and d.get("backend", report["config"].get("backend")) == backend
        ):
            return fig
    return None


def _cell(report: dict | None, t: Target, backend: str, bound: float | None) -> Cell:
    if report is None:
        return Cell(note="report missing")
    fig = _figure(report, t, backend)
    if fig is None or fig["value"] is None:
        return Cell(note=_why_missing(report, t, backend))
    value = fig["value"]
    if report["environment"].get("gpu_count", 0) < 1:  # a CPU run of the same command: no GPU figure
        return Cell(value, None, None, "CPU run, not a GPU figure")
    ran_at = {k: fig[k] if k in fig else fig["details"].get(k) for k, _ in t.settings}  # budget: a field of its own
    other = {k: ran_at[k] for k, v in t.settings if ran_at[k] != v}
    if other:
        ran = ", ".join(f"{k} {v}" for k, v in other.items())
        return Cell(value, None, None, f"ran at {ran}, not the target's settings")
    if fig["details"].get("compiled") is False:  # the target's anchor is compiled; an eager one is easier to beat
        return Cell(value, None, None, "anchor not compiled, not the target's anchor")
    share = value / (bound * t.decode_batch) if bound and t.decode_batch else None
    return Cell(
        value, value >= t.target, share, "different tokens" if fig["details"].get("same_tokens") is False else ""
    )


def _why_missing(report: dict, t: Target, backend: str) -> str:
    backends = report["config"].get("backends") or [report["config"].get("backend")]
    if backend not in backends:
        return "backend not run"
    if t.reference == "generate_static":
        summary = report["summary"].get("by_backend", {}).get(backend, report["summary"])
        anchors = [summary.get("static_anchor"), *(summary.get("engine_over_static") or {}).values()]
        errors = [a["error"] for a in anchors if isinstance(a, dict) and a.get("error")]
        if errors:
            return f"anchor failed: {errors[0]}"
    return "figure missing"


def read_targets(
    folder: str | Path, *, bandwidth: float | None, bandwidth_source: str | None, bandwidth_gpu: str | None = None
) -> dict[str, Any]:
    """Every target's cell per backend, with where each figure came from (device, commit, clock).
    A bandwidth measured on another GPU than the reports' sizes no bound."""
    folder = Path(folder)
    from kvleague.runner.bench.harness import read_report

    reports: dict[str, dict | None] = {}
    sources = {}
    for stem in REPORTS:
        path = folder / f"{stem}.json"
        report = reports[stem] = read_report(path) if path.is_file() else None
        if report is not None:
            env, config = report["environment"], report["config"]
            summary = report["summary"]
            engines = {
                b: s["engine"]
                for b, s in summary.get("by_backend", {config.get("backend"): summary}).items()
                if "engine" in s
            }
            sources[stem] = {
                "gpu": env.get("gpu_name"),
                "torch": env.get("torch_version"),
                "git_commit": env.get("git_commit"),
                "git_dirty": env.get("git_dirty"),
                "clock": config.get("clock"),
                "created_at": report["created_at"],
                "engines": engines,
            }
    gpus = sorted({s["gpu"] for s in sources.values() if s["gpu"]})
    if bandwidth_gpu is not None and gpus != [bandwidth_gpu]:
        bandwidth, bandwidth_source = None, f"measured on {bandwidth_gpu}, not the reports' GPU"
    weights = weight_bytes(reports)
    bound = bandwidth / weights if bandwidth and weights else None
    rows = []
    for t in TARGETS:
        cells = {b: _cell(reports[t.report], t, b, bound) for b in BACKENDS}
        rows.append({"target": asdict(t), "cells": {b: asdict(c) for b, c in cells.items()}})
    busy = None
    if (folder / f"{BUSY}.json").is_file():
        report = read_report(folder / f"{BUSY}.json")
        gpu = report["environment"].get("gpu_name")
        busy = {"gpu": gpu if report["environment"].get("gpu_count", 0) >= 1 else "no GPU", "rows": report["rows"]}
    return {
        "folder": str(folder),
        "gpus": gpus,
        "sources": sources,
        "busy": busy,
        "bandwidth_bytes_per_second": bandwidth,
        "bandwidth_source": bandwidth_source,
        "weight_bytes": weights,
        "bound_tokens_per_second_batch_1": bound,
        "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    """The targets table as docs/gpu.md shows it."""

    def shown(cell: dict, ratio: bool) -> str:
        if cell["value"] is None:
            return f"not measured ({cell['note']})"
        text = f"{cell['value']:.3f}x" if ratio else f"{cell['value']:,.1f}"
        if cell["met"] is not None:
            text += " (met)" if cell["met"] else " (**not met**)"
        if cell["share_of_bound"] is not None:
            text += f", {100 * cell['share_of_bound']:.2g}% of bound"
        return text + (f"; {cell['note']}" if cell["note"] else "")

    lines = ["| figure | hf backend | slab backend | target |", "|---|---|---|---|"]
    for row in result["rows"]:
        t = row["target"]
        ratio = t["decode_batch"] is None
        lines.append(
            f"| {t['label']} | {shown(row['cells']['hf'], ratio)} | {shown(row['cells']['slab'], ratio)} | "
            f">= {t['target']:g}{'x' if ratio else ''} |"
        )
    bw, wb, bound = (
        result["bandwidth_bytes_per_second"],
        result["weight_bytes"],
        result["bound_tokens_per_second_batch_1"],
    )
    gpus = [g for g in result["gpus"] if g != "none"]
    head = [f"Reports from: {', '.join(gpus) if gpus else 'no GPU (CPU runs: no figure here is a GPU figure)'}."]
    if bound:
        head.append(
            f"Bound: {bw / 1e12:.2f} TB/s (device-to-device copy, read + write; {result['bandwidth_source']}) / "
            f"{wb / 1e9:.3g} GB of weights = {bound:,.0f} tokens/s at batch 1 (x batch size at larger batches)."
        )
    else:
        why = result["bandwidth_source"] or "no bandwidth.json in the folder and no CUDA device here"
        head.append(f"Bound: not measured ({why}; or the reports name no one model and dtype).")
    for stem, s in result["sources"].items():
        paths = "".join(
            f"; {backend}: {_paths(about)}" for backend, about in s["engines"].items() if "decode_steps" in about
        )
        head.append(
            f"- `{stem}.json`: {s['gpu']}, torch {s['torch']}, git {str(s['git_commit'])[:12]}"
            f"{'+dirty' if s['git_dirty'] else ''}, clock {s['clock']}, {s['created_at']}{paths}"
        )
    text = "\n".join(head) + "\n\n" + "\n".join(lines) + "\n"
    if result["busy"]:

        def cell(value, spec):
            return "not measured" if value is None else format(value, spec)

        text += (
            f"\nDecode steps under the profiler (`{BUSY}.json`, {result['busy']['gpu']}; not a target):\n\n"
            "| backend | method | batch | device busy | kernels / token | host ops / step | ms / step |\n"
            "|---|---|---|---|---|---|---|\n"
        )
        for r in result["busy"]["rows"]:
            text += (
                f"| {r.get('backend', '-')} | {r['method']} | {r['batch_size']} | {cell(r.get('device_busy'), '.1%')} | "
                f"{cell(r.get('kernels_per_token'), '.1f')} | {cell(r.get('host_ops_per_step'), '.1f')} | "
                f"{cell(r.get('step_ms'), '.2f')} |\n"
            )
    return text


def _paths(about: dict) -> str:
    """Which path a backend's decode steps took over the whole report (the slab backend counts them)."""
    steps = ", ".join(f"{n} {path}" for path, n in about["decode_steps"].items() if n)
    captures = about.get("graph_captures")
    return f"decode steps {steps or 'none'}" + (
        f", {captures} captures taking {about['graph_capture_seconds']:.2f} s" if captures else ""
    )


def add_arguments(p) -> None:
    p.add_argument("folder", metavar="DIR", help="the folder scripts/gpu_check.sh wrote")
    p.add_argument(
        "--bandwidth-gbs",
        type=float,
        metavar="GB/S",
        help="device-to-device copy bandwidth (read + write) instead of DIR/bandwidth.json or measuring it here",
    )


def run(args) -> dict[str, Any]:
    if args.bandwidth_gbs is not None and not args.bandwidth_gbs > 0:
        raise KvleagueError(f"--bandwidth-gbs: {args.bandwidth_gbs} is not a positive number of GB/s")
    folder = Path(args.folder)
    if not folder.is_dir():
        raise KvleagueError(f"DIR: {folder} is not a directory (the folder scripts/gpu_check.sh wrote)")
    recorded = folder / "bandwidth.json"
    if args.bandwidth_gbs is not None:
        bandwidth, source, gpu = args.bandwidth_gbs * 1e9, "given (--bandwidth-gbs)", None
    elif recorded.is_file() or record_bandwidth(folder) is not None:
        record = json.loads(recorded.read_text())
        bandwidth, source, gpu = (
            record["bytes_per_second"],
            f"measured on {record['gpu']} (bandwidth.json)",
            record["gpu"],
        )
    else:
        bandwidth, source, gpu = None, None, None
    result = read_targets(folder, bandwidth=bandwidth, bandwidth_source=source, bandwidth_gpu=gpu)
    text = markdown(result)
    (folder / "targets.md").write_text(text)
    (folder / "targets.json").write_text(json.dumps(result, indent=2) + "\n")
    print(text + f"\nwrote {folder / 'targets.md'} and {folder / 'targets.json'}")
    return result
