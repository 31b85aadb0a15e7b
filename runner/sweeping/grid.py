"""Grid expansion: a checked sweep config becomes cells, each with a deterministic key (the spec hash
of everything that determines its result), and the dimension rows (model, method, task, protocol,
generation settings) the cells point at.

The grid is models x methods x hyperparameter grid x budgets x tasks x samples x n_samples x
seeds. A task entry with ``measure: fidelity`` (or ``both``) also makes *fidelity* cells: one per
(model, method, budget, sample, seed) - teacher forcing samples nothing, so no ``n_samples``; a
method that never evicts (full) only at the first budget, as it is the same at every budget. Their
key hashes ``measure: fidelity`` and the token cap in place of the generation settings and sample
index, so it can never equal a generation cell's key (whose spec is unchanged: existing databases
resume as before). A sample's fidelity cells are queued together, so a worker's kept full-cache
pass serves all its methods and budgets.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvleague.db.spec_hash import canonical_json, spec_hash
from kvleague.engine.errors import KvleagueError, first_line
from kvleague.engine.protocol import Protocol
from kvleague.runner.sweep_config import SweepConfig
from kvleague.runner.sweeping.checks import check_config, project_dir, resolve_data_dir, resolve_model_source


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
    protocol: Protocol
    generation: dict[str, Any]  # max_new_tokens, temperature, top_p, stop
    dims: dict[str, str] = field(default_factory=dict)  # dimension -> spec_hash
    attempts: int = 0
    #: "generation" or "fidelity" (then ``generation["max_new_tokens"]`` is the cap on scored tokens)
    measure: str = "generation"
    #: a fidelity cell's scored tokens: the task's reference continuation, or the model's own greedy
    #: trace of the prompt (``fidelity.reference: self``)
    fidelity_reference: str = "task"

    @property
    def sample_id(self) -> str:
        return self.sample.sample_id

    def describe(self) -> str:
        what = " fidelity" if self.measure == "fidelity" else ""
        return f"{self.model['name']} {self.method} B={self.budget} {self.task}/{self.sample_id}#{self.sample_index} seed={self.seed}{what}"


def derived_seed(seed: int, index: int) -> int:
    if index == 0:
        return seed
    return int(spec_hash({"seed": seed, "sample_index": index})[:8], 16) & 0x7FFFFFFF


@dataclass
class Grid:
    cells: list[Cell]
    dims: dict[str, dict[str, dict[str, Any]]]  # dimension -> spec_hash -> row values
    warnings: list[str]


def expand(config: SweepConfig, base_dir: Path | None = None) -> Grid:
    """Cells of ``config`` in a deterministic order (grouped by model, then task and sample)."""
    from kvleague.methods.registry import build_method
    from kvleague.tasks.registry import build_task, task_class

    base = base_dir or project_dir()
    warnings = check_config(config, base)
    data_dir = resolve_data_dir(config, base)
    dims: dict[str, dict[str, dict[str, Any]]] = collections.defaultdict(dict)

    methods = []  # (name, canonical params, spec hash, budgets of its fidelity cells)
    for entry in config.methods:
        for point in entry.points():
            built = build_method(entry.name, point)
            params = built.params()
            h = spec_hash({"name": entry.name, "params": params})
            dims["method"][h] = {
                "spec_hash": h,
                "name": entry.name,
                "params": params,
                "params_json": canonical_json(params),
            }
            # teacher forcing under a method that never evicts is the same at every budget: measured once
            methods.append((entry.name, params, h, config.budgets[:1] if built.never_evicts else config.budgets))
        non_eager = sorted({m.attn_implementation for m in config.models} - {"eager"})
        if built.needs.eager and non_eager and not any(f"method {entry.name}:" in w for w in warnings):
            warnings.append(
                f"method {entry.name}: needs eager attention (full attention columns), so its cells run "
                f"eager instead of {'/'.join(non_eager)}: slower, and attn_implementation says so per result"
            )

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
            "name": entry.name,
            "domain": cls.domain,
            "options": options,
            "dataset": source.dataset,
            "source": source.hub_id or source.url,
            "revision": source.revision,
            "scorer_version": str(cls.scorer_version),
            "metric": cls.metric,
        }
        if model_source is not None:  # lengths in this model's tokens: a different task per model
            t_spec["options"] = {**options, "length_unit": f"tokens of {model_source}"}
        if config.fidelity.reference == "self":  # scored against the model's own trace: a different task
            t_spec["options"] = {**t_spec["options"], "fidelity_reference": "self"}
        t_hash = spec_hash(t_spec)
        dims["task"][t_hash] = {"spec_hash": t_hash, **t_spec}
        protocol = config.protocol_for(cls.domain, cls.protect_prompt)
        p_spec = protocol.spec()
        p_hash = spec_hash(p_spec)
        dims["protocol"][p_hash] = {"spec_hash": p_hash, **p_spec}
        gen = {
            "max_new_tokens": entry.max_new_tokens or config.generation.max_new_tokens or int(cls.max_new_tokens),
            "temperature": float(config.generation.temperature),
            "top_p": float(config.generation.top_p),
            "stop": list(config.generation.stop if config.generation.stop is not None else cls.stop),
        }
        g_hash = spec_hash(gen)
        dims["generation"][g_hash] = {"spec_hash": g_hash, **gen}
        # a fidelity cell's settings: at most this many scored tokens, teacher-forced (nothing sampled)
        fid = {"max_new_tokens": int(config.fidelity.max_scored_tokens), "temperature": 0.0, "top_p": 1.0, "stop": []}
        f_hash = spec_hash(fid)
        if "fidelity" in entry.measures:
            dims["generation"][f_hash] = {"spec_hash": f_hash, **fid}
        return (
            entry,
            task,
            samples,
            protocol,
            {"generation": (gen, g_hash), "fidelity": (fid, f_hash)},
            t_hash,
            p_hash,
        )

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
        if model_cfg.backend != "hf":  # the default stays out of cell keys, so stored cells keep theirs
            model["backend"] = model_cfg.backend
        m_spec = {k: model[k] for k in ("source", "dtype", "attn_implementation")}
        m_hash = spec_hash(m_spec)
        dims["model"][m_hash] = {"spec_hash": m_hash, "name": model["name"], "revision": None, **m_spec}
        tokenizer = None
        if any(per_model for _, per_model in entries):
            tokenizer = load_tokenizer(model["resolved"])
        tasks = [
            shared[i] if i in shared else plan_task(entry, tokenizer, model_cfg.source)
            for i, (entry, _) in enumerate(entries)
        ]
        for entry, task, samples, protocol, settings, t_hash, p_hash in tasks:
            p_spec = protocol.spec()
            for sample in samples:
                for measure in entry.measures:
                    gen, g_hash = settings[measure]
                    # fidelity is teacher-forced: one cell per seed, never n_samples of them
                    for index in range(config.generation.n_samples if measure == "generation" else 1):
                        for seed in config.seeds:
                            for name, params, meth_hash, fidelity_budgets in methods:
                                for budget in config.budgets if measure == "generation" else fidelity_budgets:
                                    spec = {
                                        "model": m_spec,
                                        "method": name,
                                        "params": params,
                                        "budget": budget,
                                        "task": entry.name,
                                        "task_options": task.option_values(),
                                        "sample_id": sample.sample_id,
                                        "protocol": p_spec,
                                        "seed": seed,
                                    }
                                    if measure == "generation":  # the spec generation cells always had
                                        spec.update(sample_index=index, generation=gen)
                                    else:
                                        spec.update(measure=measure, max_scored_tokens=gen["max_new_tokens"])
                                        if config.fidelity.reference != "task":
                                            spec.update(reference=config.fidelity.reference)
                                    cells.append(
                                        Cell(
                                            key=spec_hash(spec),
                                            model=model,
                                            method=name,
                                            params=params,
                                            budget=budget,
                                            task=entry.name,
                                            task_options=task.option_values(),
                                            domain=task.domain,
                                            sample=sample,
                                            sample_index=index,
                                            seed=seed,
                                            gen_seed=derived_seed(seed, index),
                                            protocol=protocol,
                                            generation=gen,
                                            dims={
                                                "model": m_hash,
                                                "method": meth_hash,
                                                "task": t_hash,
                                                "protocol": p_hash,
                                                "generation": g_hash,
                                            },
                                            measure=measure,
                                            fidelity_reference=config.fidelity.reference,
                                        )
                                    )
    keys = [c.key for c in cells]
    if len(set(keys)) != len(keys):  # a task returning the same sample id twice
        raise KvleagueError("tasks: two cells share a key (a task returned duplicate sample ids)")
    return Grid(cells=cells, dims=dict(dims), warnings=warnings)


def load_tokenizer(model_spec: str):
    """The tokenizer of a model spec (converting a GGUF model on first use; no weights loaded)."""
    from transformers import AutoTokenizer

    from kvleague.runner.models.source import resolve_model

    try:
        return AutoTokenizer.from_pretrained(resolve_model(model_spec))
    except OSError as exc:
        raise KvleagueError(f"models: cannot load the tokenizer of {model_spec!r}: {first_line(exc)}") from None


#: the most cells one batch takes under ``batch_size: auto`` (the worker then fits it to memory)
AUTO_BATCH_LIMIT = 16
#: a plain task's generation group holds this many batches' cells: its worker decodes ``batch_size``
#: rows at a time and a finished row takes the next cell waiting (continuous batching), so the group
#: is not held to the longest sequence of each batch
QUEUED_BATCHES = 4


def batch_rows(batch_size: int | str) -> int:
    """The cells of one batch under the sweep's ``batch_size`` (``auto``: :data:`AUTO_BATCH_LIMIT`)."""
    return AUTO_BATCH_LIMIT if batch_size == "auto" else int(batch_size)


def spread(groups: list[list[Cell]], batch_size: int | str, workers: int) -> list[list[Cell]]:
    """``groups`` with queued generation groups (longer than one batch, :data:`QUEUED_BATCHES`) split
    back, largest first, at multiples of ``batch_size``, while there are fewer groups than
    ``workers``: a small sweep keeps every worker busy rather than queueing on a few."""
    limit = batch_rows(batch_size)
    groups = list(groups)
    while len(groups) < workers:
        at = max(
            range(len(groups)),
            key=lambda i: len(groups[i]) if groups[i][0].measure == "generation" else 0,
            default=None,
        )
        if at is None or groups[at][0].measure != "generation" or len(groups[at]) <= limit:
            break
        group = groups[at]
        cut = limit * -(-len(group) // limit // 2) if len(group) > 2 * limit else limit
        groups[at : at + 1] = [group[:cut], group[cut:]]
    return groups


def batches(cells: list[Cell], batch_size: int | str) -> list[list[Cell]]:
    """``cells`` as the groups a worker decodes together (``CellWorker.run_group``).

    A generation group is cells of one plain task under one model, method (and hyperparameters),
    budget, protocol, generation settings and seed: different samples. A fidelity group is cells of
    one sample under one model, protocol, token cap and seed: different methods and budgets, so one
    full-cache pass serves the group and its answers are teacher-forced together; scored on
    self-generated traces, it holds whole samples (at least ``batch_size`` cells, a sample never split,
    so every cell of a sample sees the one trace), whose traces decode together. At most
    ``batch_size`` cells a group (``auto``: :data:`AUTO_BATCH_LIMIT`), except a plain task's
    generation group: :data:`QUEUED_BATCHES` times that, decoded ``batch_size`` rows at a time, a
    finished row taken by the next cell (``CellWorker.run_group``). Episodes group as generation cells
    do, ``batch_size`` at most (their decodes batched round by round, ``runner.sample.run_samples``);
    an episode's fidelity cells against a reference agent stay alone (multi-segment teacher forcing:
    batch 1). Each group stands where its first cell stood."""
    from kvleague.tasks.episode import EpisodicTask
    from kvleague.tasks.registry import task_class

    limit = batch_rows(batch_size)
    groups: list[list[Cell]] = []
    open_groups: dict[str, list[Cell]] = {}
    episodic: dict[str, bool] = {}
    for cell in cells:
        if cell.task not in episodic:
            episodic[cell.task] = issubclass(task_class(cell.task), EpisodicTask)
        self_trace = cell.measure == "fidelity" and cell.fidelity_reference == "self"
        # an episode's fidelity is multi-segment (batch 1) unless scored on its own trace (one prompt, one answer)
        if limit == 1 or (episodic[cell.task] and cell.measure == "fidelity" and not self_trace):
            groups.append([cell])
            continue
        if cell.measure == "fidelity":
            # one sample's methods and budgets; scored on self-generated traces, whole samples together
            # (their traces decode as one batch), a sample never split across groups
            sample = [] if self_trace else [cell.sample_id]
            key = canonical_json(
                [
                    "fidelity",
                    cell.model,
                    cell.task,
                    cell.task_options,
                    *sample,
                    cell.dims["protocol"],
                    cell.generation,
                    cell.seed,
                ]
            )
        else:
            key = canonical_json(
                [
                    cell.model,
                    cell.method,
                    cell.params,
                    cell.budget,
                    cell.task,
                    cell.task_options,
                    cell.dims["protocol"],
                    cell.generation,
                    cell.seed,
                ]
            )
        most = limit * QUEUED_BATCHES if cell.measure != "fidelity" and not episodic[cell.task] else limit
        group = open_groups.get(key)
        if group is None or (len(group) >= most and not (self_trace and group[-1].sample_id == cell.sample_id)):
            group = open_groups[key] = []
            groups.append(group)
        group.append(cell)
    return groups
