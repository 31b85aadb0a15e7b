"""Seed a results database through the db layer's own functions (migrations, ``db.store``), for the
dashboard's tests, its load benchmark and its screenshot.

``Seeder`` creates dimension rows (model, method spec, task, protocol, generation setting, environment,
sweep) and writes sample results with ``db.store.write_results``. ``seed_realistic`` fills a database
with a synthetic but plausible sweep: a latent difficulty per problem, so methods succeed and fail on
the same hard problems (paired tests then mean something), accuracy that falls as the budget shrinks,
method-specific robustness, timings and memory that scale with the budget.

    python -m db.seed --db sqlite:///demo-leaderboard.db        # the screenshot's database
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Engine

from kvleague.db import store
from kvleague.db.models import (
    Environment,
    GenerationSpec,
    MethodSpec,
    Model,
    ProtocolSpec,
    TaskSpec,
)
from kvleague.db.spec_hash import canonical_json, spec_hash


def _hash(value: Any) -> str:
    return spec_hash(value, spaced=True)


class Seeder:
    def __init__(self, engine: Engine, migrate: bool = True):
        from kvleague.db.session import upgrade

        self.engine = engine
        if migrate:
            upgrade(engine)
        self.env_id = self.environment()

    def environment(self, hostname: str = "seed-host", gpu_name: str = "none", git_commit: str = "0" * 40) -> int:
        env = {
            "hostname": hostname,
            "platform": "Linux-x86_64",
            "python_version": "3.11.9",
            "torch_version": "2.13.0",
            "transformers_version": "5.2.0",
            "cuda_version": "none" if gpu_name == "none" else "12.8",
            "gpu_name": gpu_name,
            "gpu_count": 0 if gpu_name == "none" else 1,
            "kvleague_version": "0.1.0",
            "ray_version": "2.60.0",
            "git_commit": git_commit,
            "git_dirty": False,
        }
        return store.get_or_create(self.engine, Environment, {"spec_hash": _hash(env), **env})

    def model(self, name: str, source: str | None = None) -> int:
        spec = {"source": source or f"org/{name}", "dtype": "bfloat16", "attn_implementation": "sdpa"}
        return store.get_or_create(
            self.engine, Model, {"spec_hash": _hash(spec), "name": name, "revision": None, **spec}
        )

    def method(self, name: str, params: dict[str, Any] | None = None) -> int:
        params = dict(params or {})
        h = _hash({"name": name, "params": params})
        return store.get_or_create(
            self.engine,
            MethodSpec,
            {"spec_hash": h, "name": name, "params": params, "params_json": canonical_json(params)},
        )

    def task(self, name: str, domain: str, metric: str = "accuracy") -> int:
        spec = {
            "name": name,
            "domain": domain,
            "options": {},
            "dataset": name,
            "source": f"hub/{name}",
            "revision": None,
            "scorer_version": "1",
            "metric": metric,
        }
        return store.get_or_create(self.engine, TaskSpec, {"spec_hash": _hash(spec), **spec})

    def protocol(
        self,
        cadence: str = "every_step",
        positions: str = "absolute",
        sink: int = 4,
        recent: int = 8,
        protect_prompt: bool = False,
        prefill_chunk: int | None = None,
    ) -> int:
        spec = {
            "cadence": cadence,
            "positions": positions,
            "sink": sink,
            "recent": recent,
            "protect_prompt": protect_prompt,
            "prefill_chunk": prefill_chunk,
        }
        return store.get_or_create(self.engine, ProtocolSpec, {"spec_hash": _hash(spec), **spec})

    def generation(self, temperature: float = 0.0, top_p: float = 1.0, max_new_tokens: int = 512) -> int:
        spec = {"max_new_tokens": max_new_tokens, "temperature": float(temperature), "top_p": float(top_p), "stop": []}
        return store.get_or_create(self.engine, GenerationSpec, {"spec_hash": _hash(spec), **spec})

    def sweep(
        self, name: str, config: dict[str, Any] | None = None, git_commit: str = "0" * 40, status: str = "finished"
    ) -> int:
        config = config or {"name": name}
        sweep_id = store.start_sweep(
            self.engine,
            {
                "name": name,
                "config": config,
                "config_hash": _hash(config),
                "config_path": f"sweeps/{name}.yaml",
                "git_commit": git_commit,
                "git_dirty": False,
                "environment_id": self.env_id,
                "ray_address": None,
                "ray_job_id": None,
                "n_cells": 0,
            },
        )
        if status != "running":
            store.finish_sweep(self.engine, sweep_id, status)
        return sweep_id

    def write(self, rows: Iterable[dict[str, Any]], chunk: int = 20000) -> int:
        """Write result rows (dicts of sample_results columns; cell_key filled in when missing)."""
        n = 0
        batch: list[dict[str, Any]] = []
        for row in rows:
            # a fidelity row's key differs from the generation row of the same cell (as a sweep's does)
            measure = [row["measure"]] if row.get("measure", "generation") != "generation" else []
            row.setdefault(
                "cell_key",
                _hash(
                    [
                        row.get(k)
                        for k in (
                            "sweep_id",
                            "model_id",
                            "method_spec_id",
                            "task_id",
                            "protocol_id",
                            "generation_id",
                            "budget",
                            "sample_id",
                            "sample_index",
                            "seed",
                        )
                    ]
                    + measure
                ),
            )
            row.setdefault("environment_id", self.env_id)
            row.setdefault("status", "ok")
            row.setdefault("attempts", 1)
            batch.append(row)
            if len(batch) >= chunk:
                n += store.write_results(self.engine, batch)
                batch = []
        if batch:
            n += store.write_results(self.engine, batch)
        return n


# ------------------------------------------------------------------------------------------------
# A realistic synthetic sweep
# ------------------------------------------------------------------------------------------------

#: robustness of each method to a small budget (1: loses nothing; 0: collapses like random eviction)
ROBUSTNESS = {
    "full": 1.0,
    "epikv": 0.93,
    "lag_kv": 0.9,
    "thinkv": 0.9,
    "rkv": 0.86,
    "snapkv": 0.8,
    "h2o": 0.78,
    "tova": 0.8,
    "streaming_llm": 0.6,
    "knorm": 0.55,
    "keydiff": 0.7,
    "random": 0.3,
}
#: (task, domain, problems, full-cache accuracy, typical generated tokens)
TASKS = (
    ("math500", "math", 500, 0.75, 3000),
    ("aime24", "math", 30, 0.43, 9000),
    ("humaneval", "code", 164, 0.62, 600),
    ("kv_agent", "agentic", 100, 0.55, 900),
    ("niah", "longqa", 100, 0.9, 40),
)
BUDGETS = (1024, 2048, 4096, 8192)
METHODS = ("full", "epikv", "lag_kv", "thinkv", "rkv", "snapkv", "h2o", "tova", "streaming_llm")


@dataclass
class RealisticSpec:
    methods: tuple[str, ...] = METHODS
    budgets: tuple[int, ...] = BUDGETS
    tasks: tuple[tuple[str, str, int, float, int], ...] = TASKS
    n_samples: int = 1
    temperature: float = 0.0
    seeds: tuple[int, ...] = (0,)
    model: str = "Qwen3-8B"
    sweep: str = "synthetic"
    completion_chars: int = 300
    fail_rate: float = 0.002
    rng_seed: int = 0


def _target_accuracy(full_acc: float, method: str, budget: int, typical_tokens: int) -> float:
    if method == "full":
        return full_acc
    pressure = min(1.0, typical_tokens / budget)  # how much of the generation must be evicted
    r = ROBUSTNESS.get(method, 0.6)
    return full_acc * (1 - (1 - r) * pressure**0.8)


_WORDS = ("the", "cache", "so", "we", "get", "then", "step", "answer", "is", "thus", "x", "=", "compute", "sum", "of")


def realistic_rows(s: Seeder, spec: RealisticSpec) -> Iterable[dict[str, Any]]:
    rng = random.Random(spec.rng_seed)
    model_id = s.model(spec.model)
    protocol_id = s.protocol(sink=4, recent=64)
    gen_id = s.generation(temperature=spec.temperature, top_p=0.95 if spec.temperature else 1.0, max_new_tokens=16384)
    sweep_id = s.sweep(
        spec.sweep,
        {
            "name": spec.sweep,
            "budgets": list(spec.budgets),
            "seeds": list(spec.seeds),
            "generation": {"temperature": spec.temperature, "n_samples": spec.n_samples},
        },
    )
    method_ids = {m: s.method(m, {} if m in ("full", "random") else {"window": 32}) for m in spec.methods}
    filler = " ".join(rng.choice(_WORDS) for _ in range(max(1, spec.completion_chars // 4)))[: spec.completion_chars]
    for task, domain, n_problems, full_acc, typical in spec.tasks:
        task_id = s.task(task, domain)
        difficulty = [rng.random() for _ in range(n_problems)]
        for method in spec.methods:
            for budget in spec.budgets:
                target = _target_accuracy(full_acc, method, budget, typical)
                kv_entries = typical + 200 if method == "full" else min(budget, typical + 200)
                for i, d in enumerate(difficulty):
                    for seed in spec.seeds:
                        for j in range(spec.n_samples):
                            noise = rng.gauss(0, 0.08) if (spec.temperature or method != "full") else 0.0
                            failed = rng.random() < spec.fail_rate
                            correct = (d + noise) < target
                            tokens = max(1, int(rng.gauss(typical, typical * 0.2)))
                            evicting = method != "full" and tokens + 200 > budget
                            s_token = 0.018 + 0.000004 * kv_entries + (0.002 if evicting else 0)
                            row = {
                                "sweep_id": sweep_id,
                                "model_id": model_id,
                                "method_spec_id": method_ids[method],
                                "task_id": task_id,
                                "protocol_id": protocol_id,
                                "generation_id": gen_id,
                                "budget": budget,
                                "sample_id": f"{task}-{i:04d}",
                                "sample_index": j,
                                "seed": seed,
                            }
                            if failed:
                                row.update(status="failed", error="OutOfMemoryError: CUDA out of memory (synthetic)")
                                yield row
                                continue
                            row.update(
                                status="ok",
                                correct=correct,
                                score=1.0 if correct else 0.0,
                                extracted=str(i if correct else i + 1),
                                completion=filler,
                                stop_reason="eos",
                                prompt_tokens=200,
                                generated_tokens=tokens,
                                prefill_seconds=0.05 + rng.random() * 0.01,
                                decode_seconds_mean=s_token,
                                decode_seconds_p50=s_token,
                                decode_seconds_p95=s_token * 1.3,
                                tokens_per_second=1 / s_token,
                                method_seconds=(tokens * 0.0004 if evicting else 0.0),
                                wall_seconds=tokens * s_token + 0.06,
                                evictions=(tokens + 200 - budget) if evicting else 0,
                                evicted_tokens=(tokens + 200 - budget) if evicting else 0,
                                peak_cache_entries=min(kv_entries, tokens + 200) if method != "full" else tokens + 200,
                                peak_kv_bytes=(min(kv_entries, tokens + 200) if method != "full" else tokens + 200)
                                * 36
                                * 2
                                * 8
                                * 128
                                * 2,
                                peak_memory_bytes=16 * 2**30 + (min(kv_entries, tokens + 200)) * 147456,
                                peak_memory_source="cuda",
                                attn_implementation="sdpa",
                                worker="seed-host:1",
                            )
                            yield row


def seed_realistic(engine: Engine, spec: RealisticSpec | None = None) -> int:
    s = Seeder(engine)
    return s.write(realistic_rows(s, spec or RealisticSpec()))


def main(argv: list[str] | None = None) -> int:
    from kvleague.db.session import get_engine

    p = argparse.ArgumentParser(
        prog="python -m db.seed", description="Write a synthetic realistic sweep into a database."
    )
    p.add_argument("--db", required=True)
    p.add_argument("--n-samples", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    n = seed_realistic(get_engine(args.db), RealisticSpec(n_samples=args.n_samples, temperature=args.temperature))
    print(f"wrote {n} sample results to {args.db}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
