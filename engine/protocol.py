"""Run settings that must be identical for every method compared in one cell group: the one typed
:class:`Protocol`, validated where it enters (sweep YAML, CLI flags, lm-eval ``model_args``, Python)
and carried as that object through grid expansion and the cell worker to its database row."""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError
from pydantic_core import core_schema

from kvleague.engine.errors import KvleagueError

POSITION_MODES = ("absolute", "compact")
PROMPT_OVER_BUDGET = ("error", "keep")


def parse_bool(value: Any) -> bool:
    """A flag given as text ("true", "1", "yes", "on": true) or as a value."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def parse_optional(parse):
    """``parse``, with the spellings of "not set" (empty, None, null) mapping to None."""

    def parsed(value: Any) -> Any:
        return None if value in (None, "", "None", "none", "null") else parse(value)

    parsed.__name__ = parse.__name__  # argparse names the type in its error: "invalid int value"
    return parsed


@dataclass(frozen=True)
class Cadence:
    """When the engine evicts: ``every_step`` (``buffer`` 0: the cache holds <= B after every decode
    step) or ``buffer=N`` (the cache grows to B + N, then is evicted down to B in one go). Written as
    that text in YAML, flags, hashes and database rows."""

    buffer: int = 0

    ALLOWED: ClassVar[str] = "every_step, buffer=N"

    @classmethod
    def parse(cls, value: Any) -> Cadence:
        """``every_step`` or ``buffer=N`` (N >= 1); raises ValueError saying what is allowed."""
        if isinstance(value, Cadence):
            return value
        if value == "every_step":
            return cls(0)
        if isinstance(value, str) and value.startswith("buffer="):
            try:
                buffer = int(value.split("=", 1)[1])
            except ValueError:
                buffer = 0
            if buffer >= 1:
                return cls(buffer)
            raise ValueError(f"{value!r} needs a positive integer N; allowed: {cls.ALLOWED}")
        raise ValueError(f"unknown {value!r}; allowed: {cls.ALLOWED}")

    def __str__(self) -> str:
        return "every_step" if self.buffer == 0 else f"buffer={self.buffer}"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        """In a pydantic model: parsed from its text (or taken as is), dumped as its text."""
        return core_schema.no_info_plain_validator_function(
            cls.parse, serialization=core_schema.plain_serializer_function_ser_schema(str)
        )


class Protocol(BaseModel):
    """How the engine applies a budget, whatever the method.

    * ``cadence``: when to evict (:class:`Cadence`): ``every_step`` is a hard cap (the cache holds <= B
      after every decode step); ``buffer=N`` amortises scoring, as R-KV and SnapKV-decode do.
    * ``positions``: ``"absolute"`` feeds every new query its true position in the sequence (cached
      keys keep their original RoPE); ``"compact"`` feeds position = current cache length, as the
      EpiKV authors' harness (and any HF code that lets positions follow the cache length) does.
    * ``sink`` / ``recent``: the first ``sink`` and the last ``recent`` tokens are never evicted.
    * ``protect_prompt``: prompt tokens (everything fed, as opposed to generated) are never evicted
      (EpiKV's setting for reasoning).
    * ``prefill_chunk``: prompts are prefilled in chunks of this many tokens and compressed to B after
      each chunk, so the cache never holds more than B + chunk entries; ``None`` = whole prompt.
    * ``recent_max_fraction``: when set, the recent window is ``min(recent, int(B * fraction))``
      (the EpiKV authors' harness: ``min(128, B // 4)``); ``None`` = ``recent`` as given.
    * ``budget_base``: ``"none"``: B is the number of cache entries; ``"prompt"``: B is room for
      generated tokens on top of the prompt, so every sample, whatever its prompt length, has the
      same room (the EpiKV paper's regime: its budgets of 4,096-8,192 entries are nearly all room for
      reasoning tokens beside prompts of ~100-200). A sample's budget is resolved where its prompt is
      known (:meth:`for_prompt`): prompt tokens + B, with the recent window counted from B (a
      quarter of the room under the authors' ``recent_max_fraction``), so the engine only ever sees
      an absolute budget.
      ``"ratio"``: B / 1000 is kvpress's ``compression_ratio`` of the compressed part (the context under
      ``scope: context``, else the prompt): it keeps ``max(1, int(n * (1 - B / 1000)))`` of its n
      tokens, as kvpress's ``compute_n_kept`` (``budgets: [ratio 0.5]`` in a sweep is B = 500).
    * ``scope``: ``"all"``: every token fed or generated is held to the budget; ``"context"``
      (kvpress's pipeline): only the first feed (the context) is compressed, once, after its prefill;
      the question, the chat template's suffix and the generated tokens are then added uncompressed
      over it. ``query_aware`` (with ``context``): the question is part of the compressed context
      (kvpress's ``query_aware`` evaluation), so only the template's suffix is added after it.
    * ``prompt_over_budget`` (with ``protect_prompt``): ``"error"`` refuses a prompt that, with the
      sink and recent window, does not fit in B; ``"keep"`` (the EpiKV authors' harness) keeps the
      whole prompt even when it alone exceeds B: the cache then holds max(B, prompt) entries, the
      sink and recent window share what the prompt leaves (most recent first), and a prompt >= B
      leaves nothing, so every generated token is dropped right after its own forward pass.

    On equal scores the engine keeps the more recent position (``engine/cache.py``); the
    protected tiers rank prompt > sink / recent window > any method score.

    Named presets (:data:`PRESETS`, ``protocol: <name>`` in a sweep YAML, ``--protocol <name>`` on the
    CLI): ``epikv_paper`` is everything the EpiKV authors' ``scripts/benchmark.py`` sets for the
    EpiKV family and LagKV: prompt kept whole, recent window ``min(128, B // 4)``, eviction after
    every decode step and never after prefill (a no-op under a kept prompt), positions = cache
    length, no sink, whole-prompt prefill.

    The field list is the one list the CLI flags, the sweep YAML, the lm-eval bridge, the spec hash,
    the ``protocols`` table's columns (``db/models.py``) and the dashboard's label follow; each
    field's ``description`` is its flag's help. Invalid values raise one-line KvleagueErrors naming
    the field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    _ratio: float | None = PrivateAttr(default=None)

    cadence: Cadence = Field(default=Cadence(), description="every_step or buffer=N")
    positions: Literal["absolute", "compact"] = Field(default="absolute", description="absolute or compact")
    sink: int = Field(default=0, ge=0, description="first tokens never evicted")
    recent: int = Field(default=0, ge=0, description="last tokens never evicted")
    protect_prompt: bool = Field(default=False, description="never evict prompt tokens")
    prefill_chunk: int | None = Field(
        default=None, ge=1, description="prefill in chunks of this many tokens (default: the whole prompt)"
    )
    recent_max_fraction: float | None = Field(
        default=None, ge=0, le=1, description="cap the recent window at this fraction of the budget"
    )
    prompt_over_budget: Literal["error", "keep"] = Field(
        default="error", description="with protect_prompt, a prompt over the budget: error or keep"
    )
    budget_base: Literal["none", "prompt", "ratio"] = Field(
        default="none",
        description="none (B cache entries), prompt (B entries on top of the prompt) or ratio (B/1000 of the context evicted)",
    )
    scope: Literal["all", "context"] = Field(
        default="all", description="all (every token held to the budget) or context (the context compressed once)"
    )
    query_aware: bool = Field(default=False, description="with scope context: the question is compressed with it")

    #: Fields added after results were stored (with the presets, issue 14). A protocol whose value of
    #: one is the field's default leaves it out of its spec (hashed, and stored with NULL in its
    #: column), so the spec hashes stored before the field existed (cell keys, protocol rows) still
    #: match. The one place this rule lives: :meth:`spec` and :meth:`from_spec` apply it.
    ADDED_LATER: ClassVar[tuple[str, ...]] = (
        "recent_max_fraction",
        "prompt_over_budget",
        "budget_base",
        "scope",
        "query_aware",
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise KvleagueError(_one_line(exc)) from None

    @property
    def ratio(self) -> float | None:
        """The compression ratio a ratio budget was given as (B / 1000), on the protocol
        :meth:`for_prompt` resolved from it; None otherwise. Not a field: the budget is the cell's, and
        a press defined by its ratio (kvpress's ``CompactorPress`` blends by it) reads it."""
        return self._ratio

    @property
    def buffer(self) -> int:
        """Entries the cache may hold beyond the budget before it is evicted (0: every step)."""
        return self.cadence.buffer

    def spec(self) -> dict[str, Any]:
        """The protocol as hashed (cell keys, the protocol's ``spec_hash``) and stored (its row):
        every field as JSON, those of :attr:`ADDED_LATER` left out at their defaults."""
        return {
            name: value
            for name, value in self.model_dump(mode="json").items()
            if not (name in self.ADDED_LATER and getattr(self, name) == type(self).model_fields[name].default)
        }

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Protocol:
        """The protocol of a spec or a stored row (other keys such as ``id`` ignored; a field of
        :attr:`ADDED_LATER` missing or NULL is at its default)."""
        return cls(
            **{
                name: spec[name]
                for name in cls.model_fields
                if name in spec and not (name in cls.ADDED_LATER and spec[name] is None)
            }
        )

    @classmethod
    def from_text(cls, values: dict[str, Any]) -> Protocol:
        """A protocol from values given as text (lm-eval ``model_args``), each parsed by its field."""
        parsers = {f.name: f.parse for f in protocol_fields()}
        return cls(**{k: parsers[k](v) if k in parsers else v for k, v in values.items()})

    @classmethod
    def preset(cls, name: str, **overrides) -> Protocol:
        """The protocol of preset ``name`` (see :data:`PRESETS`), with ``overrides`` on top."""
        if name not in PRESETS:
            raise KvleagueError(f"protocol: unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name].model_dump(), **overrides})

    def recent_for(self, budget: int) -> int:
        """The recent window under budget ``budget``."""
        if self.recent_max_fraction is None:
            return self.recent
        return min(self.recent, int(budget * self.recent_max_fraction))

    def for_prompt(self, budget: int, prompt_tokens: int) -> tuple[Protocol, int]:
        """``(protocol, budget)`` the engine runs for one sample whose prompt has ``prompt_tokens``
        tokens: unchanged under ``budget_base: none``; under ``prompt``, an absolute protocol whose
        recent window is the one of room ``budget`` and the budget ``prompt_tokens + budget``; under
        ``ratio``, the budget kvpress keeps of ``prompt_tokens`` (the context) at ratio ``budget / 1000``."""
        if self.budget_base == "none":
            return self, budget
        if self.budget_base == "ratio":
            resolved = type(self)(**{**self.model_dump(), "budget_base": "none"})
            resolved._ratio = budget / 1000
            return resolved, kept_at_ratio(prompt_tokens, budget / 1000)
        fields = {
            **self.model_dump(),
            "budget_base": "none",
            "recent": self.recent_for(budget),
            "recent_max_fraction": None,
        }
        return type(self)(**fields), prompt_tokens + budget

    def for_prompts(self, budget: int, prompt_tokens: Sequence[int]) -> tuple[Protocol, list[int]]:
        """:meth:`for_prompt` of prompts decoded together: the one protocol they share (under
        ``prompt``, it depends on the room alone) and each prompt's budget."""
        return self.for_prompt(budget, 0)[0], [self.for_prompt(budget, n)[1] for n in prompt_tokens]

    def check_budget(self, budget: int) -> None:
        if self.budget_base == "ratio" and not 0 < budget < 1000:
            raise KvleagueError(f"budget: a ratio budget is in thousandths, 1..999 (ratio 0.001..0.999), got {budget}")
        if self.budget_base == "ratio":
            return
        if budget < 1:
            raise KvleagueError(f"budget: must be a positive integer, got {budget}")
        recent = self.recent_for(budget)
        if self.sink + recent >= budget:
            raise KvleagueError(
                f"budget: {budget} leaves no evictable slot after sink ({self.sink}) + recent ({recent}); "
                f"use a budget > {self.sink + recent}"
            )


def kept_at_ratio(n: int, ratio: float) -> int:
    """Entries kept of ``n`` at compression ratio ``ratio``: ``max(1, int(n * (1 - ratio)))``, as
    kvpress's ``compute_n_kept`` (what a ``ratio`` budget resolves to)."""
    return max(1, int(n * (1 - ratio)))


def _one_line(exc: ValidationError) -> str:
    """A pydantic error as ``field: problem`` (``cadence: unknown 'x'; allowed: every_step, buffer=N``)."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "protocol"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown protocol field; allowed: {', '.join(Protocol.model_fields)}"
    msg = err["msg"].removeprefix("Value error, ")
    shown = "" if err["type"] == "value_error" else f" (got {err.get('input')!r})"
    return f"{where}: {msg}{shown}"


@dataclass(frozen=True)
class ProtocolField:
    """A field of :class:`Protocol` as the text edges see it: a CLI flag, an lm-eval ``model_args`` key."""

    name: str
    help: str
    #: text -> value (the protocol then validates it)
    parse: Callable[[Any], Any]
    #: the closed set of values, for a field of ``Literal`` type
    choices: tuple[str, ...] | None
    #: a bool field: a switch on the command line
    switch: bool


def _text_parser(annotation: Any) -> Callable[[Any], Any]:
    """How text becomes a value of ``annotation`` (bool, int, float, optional, literal, Cadence)."""
    args = get_args(annotation)
    if isinstance(annotation, types.UnionType) and type(None) in args:
        return parse_optional(_text_parser(next(a for a in args if a is not type(None))))
    if annotation is bool:
        return parse_bool
    if annotation in (int, float):
        return annotation
    return str  # Literal and Cadence: the protocol parses (and names what is allowed)


def protocol_fields() -> tuple[ProtocolField, ...]:
    """The fields of :class:`Protocol`, in order, with their text parsers derived from their types."""
    return tuple(
        ProtocolField(
            name=name,
            help=f.description or "",
            parse=_text_parser(f.annotation),
            choices=get_args(f.annotation) if get_origin(f.annotation) is Literal else None,
            switch=f.annotation is bool,
        )
        for name, f in Protocol.model_fields.items()
    )


#: named protocols: every field set, so a preset in a sweep YAML leaves nothing to a task's default
PRESETS: dict[str, Protocol] = {
    # EpiKV authors' harness (stevenkolawole/epiphany-kv-cache scripts/benchmark.py + the EpiKV family's
    # and LagKVEviction's evict_past_key_values): EvictionConfig(keep_recent_k=128) capped at B // 4,
    # the prompt always kept, eviction after every decode forward, no position_ids (= cache length).
    "epikv_paper": Protocol(
        cadence="every_step",
        positions="compact",
        sink=0,
        recent=128,
        recent_max_fraction=0.25,
        protect_prompt=True,
        prompt_over_budget="keep",
        prefill_chunk=None,
    ),
    # kvpress's KVPressTextGenerationPipeline: the context compressed once by its whole-context prefill,
    # the question and the template's suffix fed uncompressed after it, budgets as compression ratios
    "kvpress": Protocol(
        cadence="every_step",
        positions="absolute",
        sink=0,
        recent=0,
        protect_prompt=False,
        prefill_chunk=None,
        budget_base="ratio",
        scope="context",
        query_aware=False,
    ),
}


@dataclass(frozen=True)
class GenerationSettings:
    """Decoding settings. ``temperature == 0`` is greedy decoding."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    #: token ids never chosen (their logits set to -inf before sampling): a reference trace bans the
    #: end-of-turn and other special tokens so it runs its full length (``runner/fidelity.py``)
    suppress: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise KvleagueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise KvleagueError(f"temperature: must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise KvleagueError(f"top_p: must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "suppress", tuple(int(t) for t in self.suppress))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
