"""Sweep configuration: a YAML file validated once, at the edge.

Every model is strict (``extra="forbid"``); any problem becomes one :class:`KvleagueError` line that
names the field (``methods[1].grid.window``) and, where there is a closed set, the allowed values.
Structural checks are pydantic's; semantic ones (method and task names and hyperparameters, the
database URL, budgets against the protocol) use the same registries and constructors the runner
uses, so a config that validates can run.

Strings may reference the environment: ``${VAR}`` or ``${VAR:-default}``.

Layout (see ``sweeps/demo.yaml``)::

    name: demo
    database: sqlite:///kvleague.db        # or postgresql+psycopg://...
    data_dir: null                          # default: $KVLEAGUE_DATA_DIR, else the Hub
    models: [{source: artifacts/tiny-llama, dtype: auto, attn_implementation: sdpa}]
    methods:                                # or "methods: all" (every registered method, defaults)
      - full
      - {name: streaming_llm, params: {...}, grid: {hyperparameter: [v1, v2]}}
    budgets: [32, 64]                       # or [prompt+64, prompt+128]: room on top of each prompt;
                                            # or [ratio 0.25, ratio 0.5]: kvpress's compression ratios
    tasks: [{name: math500, limit: 2, options: {}, optional: false, measure: generation}]  # or fidelity, both
    protocol: {cadence: every_step, positions: absolute, sink: 0, recent: 0, protect_prompt: null, prefill_chunk: null}
    protocol_by_domain: {longqa: {protect_prompt: false, prefill_chunk: 512}}
    generation: {temperature: 0.0, top_p: 1.0, n_samples: 1, max_new_tokens: null, stop: null}
    fidelity: {max_scored_tokens: 64, reference: task}   # measure: fidelity or both; reference: self =
                                            # the model's own greedy trace, max_scored_tokens long
    seeds: [0]
    resources: {workers: null, cpus_per_worker: 1, gpus_per_worker: null, ...}
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from kvleague.db.spec_hash import spec_hash
from kvleague.engine import Backend
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import PRESETS, Protocol
from kvleague.tasks.base import Domain

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Attention = Literal["sdpa", "eager", "flash_attention_2"]
#: integers stored in INTEGER columns (budgets, seeds, token counts) must fit in 32 bits (PostgreSQL)
INT32 = 2**31 - 1

_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)
    #: fields added after sweeps were stored -> the values at which a dump leaves them out, so every
    #: stored config (and its hash) still reads the same
    ADDED_LATER: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_serializer(mode="wrap")
    def _without_added_defaults(self, handler) -> dict[str, Any]:
        data = handler(self)
        for name, defaults in self.ADDED_LATER.items():
            if name in data and data[name] in defaults:
                del data[name]
        return data


class ModelConfig(_Strict):
    """A checkpoint: Hub id (``org/name``) or local directory (relative to the project directory)."""

    source: str = Field(min_length=1)
    name: str | None = None
    dtype: Dtype = "auto"
    attn_implementation: Attention = "sdpa"
    #: the engine backend (``engine/backend.py``)
    backend: Backend = "hf"
    ADDED_LATER = {"backend": ("hf",)}

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"source": value} if isinstance(value, str) else value

    @property
    def label(self) -> str:
        return self.name or self.source.rstrip("/").split("/")[-1]


class MethodConfig(_Strict):
    """A method with fixed ``params`` and a ``grid`` (hyperparameter -> list of values, crossed)."""

    name: str = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    grid: dict[str, list[Any]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _grid(self) -> MethodConfig:
        for key, values in self.grid.items():
            if not values:
                raise ValueError(f"grid.{key}: needs at least one value")
            if key in self.params:
                raise ValueError(f"grid.{key}: also set in params; set it in one place")
        return self

    def points(self) -> list[dict[str, Any]]:
        """Every hyperparameter assignment of this entry (params + one value per grid key)."""
        keys = sorted(self.grid)
        out = []
        for combo in itertools.product(*(self.grid[k] for k in keys)):
            out.append({**self.params, **dict(zip(keys, combo))})
        return out


class TaskConfig(_Strict):
    name: str = Field(min_length=1)
    limit: int | None = Field(default=None, ge=1)
    options: dict[str, Any] = Field(default_factory=dict)
    #: seed of the deterministic sample subset (the same samples for every generation seed)
    sample_seed: int = Field(default=0, ge=0)
    #: skip (with a warning) instead of failing when no task of this name is registered
    optional: bool = False
    max_new_tokens: int | None = Field(default=None, ge=1, le=INT32)
    #: generation (the task's score), fidelity (teacher-forced KL to the full cache on the task's reference
    #: continuation, ``runner/fidelity.py``), or both
    measure: Literal["generation", "fidelity", "both"] = "generation"

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @property
    def measures(self) -> tuple[str, ...]:
        """The kinds of cell this entry makes, in the order they run."""
        return ("generation", "fidelity") if self.measure == "both" else (self.measure,)


def _protocol_model(name: str, *, overrides: bool) -> type[BaseModel]:
    """What a sweep YAML may say of a :class:`engine.protocol.Protocol`: its fields, types,
    bounds and parsers (integers also capped at ``INT32``), where a field may be left to others:
    ``protect_prompt`` null is the task's own default (``Task.protect_prompt``); with ``overrides``
    every field may be null (not overridden). :meth:`SweepConfig.protocol_for` makes the Protocol."""
    fields: dict[str, Any] = {}
    for field_name, f in Protocol.model_fields.items():
        metadata = list(f.metadata)
        if f.annotation in (int, int | None):
            metadata.append(Field(le=INT32))
        nullable = overrides or field_name == "protect_prompt"
        annotation: Any = f.annotation
        if nullable:
            annotation = annotation | None
        fields[field_name] = (
            Annotated[(annotation, *metadata)] if metadata else annotation,
            Field(default=None if nullable else f.default),
        )
    return create_model(name, __base__=_ProtocolFields, **fields)


class _ProtocolFields(_Strict):
    # at its default, or not overridden
    ADDED_LATER = {"budget_base": (None, "none"), "scope": (None, "all"), "query_aware": (None, False)}


class ProtocolConfig(_protocol_model("ProtocolConfig", overrides=False)):
    @model_validator(mode="before")
    @classmethod
    def _preset(cls, value: Any) -> Any:
        """``protocol: epikv_paper`` is that preset's fields (``engine.protocol.PRESETS``)."""
        if isinstance(value, str):
            if value not in PRESETS:
                raise ValueError(f"unknown preset {value!r}; allowed: {', '.join(PRESETS)}")
            return PRESETS[value].model_dump()
        return value


class ProtocolOverride(_protocol_model("ProtocolOverride", overrides=True)):
    """A domain's changes to the sweep's protocol: any field, null where not overridden."""


class GenerationConfig(_Strict):
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n_samples: int = Field(default=1, ge=1, le=1000)
    #: ``null``: the task's default (``Task.max_new_tokens``); a task entry's own value wins
    max_new_tokens: int | None = Field(default=None, ge=1, le=INT32)
    #: ``null``: the task's stop strings
    stop: list[str] | None = None

    @model_validator(mode="after")
    def _sampling(self) -> GenerationConfig:
        if self.n_samples > 1 and self.temperature == 0:
            raise ValueError(
                "n_samples: greedy decoding (temperature 0) gives identical samples; set temperature > 0 or n_samples: 1"
            )
        return self


class FidelityConfig(_Strict):
    #: teacher-forced (scored) tokens per sample at most: the reference continuation is cut there
    max_scored_tokens: int = Field(default=64, ge=1, le=INT32)
    #: what is teacher-forced: ``task``, the task's reference continuation; ``self``, the model's own
    #: greedy full-cache continuation of the prompt, exactly ``max_scored_tokens`` long
    #: (``runner.fidelity.self_traces``: long traces, the paper's regime)
    reference: Literal["task", "self"] = "task"
    ADDED_LATER = {"reference": ("task",)}


class ResourcesConfig(_Strict):
    #: number of actors; default: one per GPU when the cluster has GPUs, else one per cpus_per_worker CPUs
    workers: int | None = Field(default=None, ge=1, le=4096)
    cpus_per_worker: float = Field(default=1, gt=0)
    #: default (null): 1 when the cluster has GPUs, else 0
    gpus_per_worker: float | None = Field(default=None, ge=0)
    torch_threads: int | None = Field(default=None, ge=1)
    max_restarts: int = Field(default=3, ge=0, le=100)
    max_task_retries: int = Field(default=2, ge=0, le=100)
    #: a cell whose worker dies this many times is stored as failed
    max_cell_attempts: int = Field(default=3, ge=1, le=20)
    #: results are written in batches of this many (or every flush_seconds)
    batch_size: int = Field(default=32, ge=1, le=10000)
    flush_seconds: float = Field(default=5.0, gt=0)
    #: calls queued per actor (pipelining hides the driver round trip)
    in_flight_per_worker: int = Field(default=2, ge=1, le=64)
    #: a cell running longer (model loading included) is stored as failed and its worker replaced; null: no limit
    cell_timeout_seconds: float | None = Field(default=3600.0, gt=0)
    #: CPU memory a worker may map beyond what it has at start (RLIMIT_AS, Linux; CPU workers only:
    #: CUDA needs more address space than memory); a cell that needs more is stored as failed (out
    #: of memory) and the worker goes on; null: no cap
    memory_limit_gb: float | None = Field(default=None, gt=0)
    #: how long the driver keeps retrying (with backoff) a database it lost before it stops
    db_retry_seconds: float = Field(default=600.0, gt=0)
    #: the memory a worker plans for (GiB): eager attention runs in query chunks so that one layer's
    #: attention buffers take at most an eighth of it, and a long prefill's rows for a method that
    #: accumulates them (H2O) are kept as sums (engine/eager.py); memory_limit_gb is the hard cap
    worker_memory_gb: float = Field(default=8.0, gt=0, le=4096)
    ADDED_LATER = {"worker_memory_gb": (8.0,)}


#: fields that say where results go or how cells are grouped, not what they compute: left out of the config hash
UNHASHED_FIELDS = ("database", "batch_size")
#: the largest ``batch_size`` a sweep may ask for
MAX_BATCH_SIZE = 256


def _relative_budget(budget: Any, base: str, allowed: str) -> int:
    """``prompt+64`` -> 64; ``ratio 0.25`` -> 250 (thousandths), under ``base``; else a one-line error."""
    text = str(budget).replace(" ", "")
    if isinstance(budget, str) and base == "prompt" and text.startswith("prompt+") and text[7:].isdigit():
        return int(text[7:])
    if isinstance(budget, str) and base == "ratio" and re.fullmatch(r"ratio0?\.\d{1,3}", text):
        thousandths = round(float(text[5:]) * 1000)
        if thousandths > 0:
            return thousandths
    raise KvleagueError(f"budgets: got {budget!r}; allowed: {allowed}")


class SweepConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=200)
    description: str | None = None
    database: str = Field(default_factory=lambda: os.environ.get("KVLEAGUE_DB") or "sqlite:///kvleague.db")
    data_dir: str | None = None
    models: list[ModelConfig] = Field(min_length=1)
    methods: list[MethodConfig] = Field(min_length=1)
    budgets: list[int] = Field(min_length=1)
    tasks: list[TaskConfig] = Field(min_length=1)
    protocol: ProtocolConfig = Field(default_factory=ProtocolConfig)
    protocol_by_domain: dict[Domain, ProtocolOverride] = Field(default_factory=dict)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    fidelity: FidelityConfig = Field(default_factory=FidelityConfig)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    #: how many generation cells (samples of one task under one model, method, budget, protocol and
    #: settings; episodes too) decode together (``runner.sample.run_samples``; a plain task's finished
    #: row is taken by the next cell of its group, ``grid.QUEUED_BATCHES`` batches long), and how many
    #: fidelity cells of one sample are teacher-forced together; ``auto``: up to 16, as many as fit in memory.
    #: An episode's fidelity cells against its reference agent run one at a time. Not part of the config hash:
    #: each sequence of a batch decodes as it would alone (docs/batching.md).
    batch_size: int | Literal["auto"] = "auto"

    @field_validator("batch_size", mode="before")
    @classmethod
    def _batch_size(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_BATCH_SIZE):
            return value
        raise ValueError(f"got {value!r}; allowed: auto or an integer 1..{MAX_BATCH_SIZE}")

    #: what :func:`check_config` found, and for which config and project directory: a config is
    #: checked once, at the edge (the CLI, or ``expand`` for one built in code), however many
    #: callers ask
    _checked: tuple[str, str, list[str]] | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _all_methods(cls, value: Any) -> Any:
        """``methods: all`` is every registered method at its defaults (the stored config lists them)."""
        if isinstance(value, dict) and value.get("methods") == "all":
            from kvleague.methods.registry import available_methods

            value = {**value, "methods": list(available_methods())}
        return value

    @model_validator(mode="before")
    @classmethod
    def _relative_budgets(cls, value: Any) -> Any:
        """``budgets: [prompt+64, prompt+128]``: room on top of each sample's prompt, i.e. budgets 64
        and 128 under the protocol with ``budget_base: prompt``; ``budgets: [ratio 0.25, ratio 0.5]``:
        kvpress's compression ratios of each sample's context, i.e. budgets 250 and 500 (thousandths)
        under ``budget_base: ratio``. Every budget of one form."""
        if not isinstance(value, dict) or not isinstance(value.get("budgets"), list):
            return value
        budgets = value["budgets"]
        if not any(isinstance(b, str) for b in budgets):
            return value
        allowed = "all integers, all prompt+N (N a positive integer), or all ratio R (0 < R < 1, at most 3 decimals)"
        base = "ratio" if str(budgets[0]).startswith("ratio") else "prompt"
        parsed = [_relative_budget(b, base, allowed) for b in budgets]
        protocol = value.get("protocol") or {}
        if isinstance(protocol, str):
            if protocol not in PRESETS:
                return value  # the protocol's own validator names the unknown preset
            protocol = {**PRESETS[protocol].model_dump(), "budget_base": None}
        if protocol.get("budget_base") not in (None, base):
            form = "ratio R" if base == "ratio" else "prompt+N"
            raise KvleagueError(f"budgets: {form} needs protocol.budget_base {base}, got {protocol['budget_base']!r}")
        return {**value, "budgets": parsed, "protocol": {**(protocol or {}), "budget_base": base}}

    @field_validator("budgets", "seeds")
    @classmethod
    def _distinct_int32(cls, value: list[int], info) -> list[int]:
        """Budgets are positive, seeds >= 0; both fit an INTEGER column and are listed once."""
        least, too_small = (1, "must be positive integers") if info.field_name == "budgets" else (0, "must be >= 0")
        for v in value:
            if v < least:
                raise ValueError(f"{too_small}, got {v}")
            if v > INT32:
                raise ValueError(f"must be at most {INT32}, got {v}")
        if len(set(value)) != len(value):
            raise ValueError(f"duplicate {info.field_name[:-1]} in {value}")
        return value

    def canonical(self) -> dict[str, Any]:
        """The config as stored with a sweep (a database password is masked)."""
        data = self.model_dump(mode="json")
        try:
            from sqlalchemy.engine import make_url

            data["database"] = make_url(self.database).render_as_string(hide_password=True)
        except Exception:
            pass
        return data

    def config_hash(self) -> str:
        """What the sweep computes: everything but where results go."""
        data = {k: v for k, v in self.canonical().items() if k not in UNHASHED_FIELDS}
        return spec_hash(data, spaced=True)

    def protocol_for(self, domain: Domain, task_protect_prompt: bool) -> Protocol:
        """The protocol of a task of ``domain``: the base fields, then the domain's overrides, then
        the task's own ``protect_prompt`` where neither sets it."""
        fields = self.protocol.model_dump()
        override = self.protocol_by_domain.get(domain)
        if override is not None:
            fields.update({k: v for k, v in override.model_dump().items() if v is not None})
        if fields["protect_prompt"] is None:
            fields["protect_prompt"] = bool(task_protect_prompt)
        return Protocol(**fields)


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------


def expand_env(value: Any) -> Any:
    """``${VAR}`` / ``${VAR:-default}`` in every string of a YAML tree."""
    if isinstance(value, str):

        def sub(m: re.Match) -> str:
            name, default = m.group(1), m.group(2)
            got = os.environ.get(name)
            if got:
                return got
            if default is not None:
                return default
            raise KvleagueError(
                f"environment variable {name} is not set (used as ${{{name}}}; write ${{{name}:-default}} for a default)"
            )

        out = _ENV_RE.sub(sub, value)
        return out if out != "" or value == "" else None
    if isinstance(value, list):
        return [expand_env(v) for v in value]
    if isinstance(value, dict):
        return {k: expand_env(v) for k, v in value.items()}
    return value


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that holds the field at ``loc[:-1]`` (for listing allowed fields)."""
    model: Any = SweepConfig
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = _inner_model(field.annotation)
    return model


def _inner_model(tp: Any) -> type[BaseModel] | None:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in get_args(tp):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a message stays one readable line)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def clip(message: str, limit: int = 1000) -> str:
    """A message cut in the middle when an input it echoes is enormous: the field it names (at the
    start) and the allowed values (at the end) stay."""
    if len(message) <= limit:
        return message
    half = limit // 2 - 20
    return f"{message[:half]} ...({len(message) - 2 * half} characters cut)... {message[-half:]}"


def format_validation_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "tagged-union"))))
    # pydantic puts the union branch name into loc for the str-or-dict shorthands
    loc = tuple(p for p in loc if p not in ("str", "dict[str,any]", "ModelConfig", "MethodConfig", "TaskConfig"))
    kind = err["type"]
    where = _loc(loc)
    if kind == "extra_forbidden":
        holder = _model_at(loc)
        allowed = ", ".join(holder.model_fields) if holder else "?"
        return f"{where}: unknown field; allowed: {allowed}"
    if kind == "missing":
        return f"{where}: required field is missing"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if msg.startswith("Assertion failed, "):
        msg = msg[len("Assertion failed, ") :]
    got = err.get("input")
    shown = "" if kind.startswith("value_error") or isinstance(got, (dict, list)) else f" (got {_short(got)})"
    if kind == "value_error" and re.match(r"^[A-Za-z_][\w.\[\]]*: ", msg):
        # a model validator's message starts with the field it is about ("grid.window: ...")
        return f"{where}.{msg}".replace("\n", " ") if loc else msg.replace("\n", " ")
    return f"{where}: {msg}{shown}".replace("\n", " ")


def parse_config(data: Any) -> SweepConfig:
    if not isinstance(data, dict):
        raise KvleagueError(f"top level: expected a mapping of fields, got {type(data).__name__}")
    try:
        return SweepConfig.model_validate(expand_env(data))
    except ValidationError as exc:
        raise KvleagueError(format_validation_error(exc)) from None


def load_config(path: str | os.PathLike[str]) -> SweepConfig:
    """Read and validate a sweep YAML file (its names and files are checked against this machine by
    ``runner.sweeping.checks.load_checked_config``)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KvleagueError(f"config: no such file {str(p)!r}") from None
    except OSError as exc:
        raise KvleagueError(f"config: cannot read {str(p)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise KvleagueError(f"config {p}: not UTF-8 text (byte {exc.start})") from None
    try:  # libyaml's parser where present: linear on enormous or deeply nested input, unlike PyYAML's
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise KvleagueError(f"config {p}: invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise KvleagueError(f"config {p}: nested too deeply to be a sweep config") from None
    try:
        config = parse_config(data)
    except KvleagueError as exc:
        raise KvleagueError(clip(f"config {p}: {exc}")) from None
    except RecursionError:
        raise KvleagueError(f"config {p}: nested too deeply to be a sweep config") from None
    return config
