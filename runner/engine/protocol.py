"""Run settings that must be identical for every method compared in one cell group."""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any, Literal

from runner.engine.errors import KvleagueError

CADENCES = ("every_step", "buffer=N")
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
class Protocol:
    """How the engine applies a budget, whatever the method.

    * ``cadence``: ``"every_step"`` evicts whenever the cache exceeds the budget B (hard cap: the
      cache holds <= B after every decode step); ``"buffer=N"`` lets the cache grow to B + N and then
      evicts down to B in one go (amortised scoring, as R-KV and SnapKV-decode do).
    * ``positions``: ``"absolute"`` feeds every new query its true position in the sequence (cached
      keys keep their original RoPE); ``"compact"`` feeds position = current cache length, as the
      EpiKV authors' harness (and any HF code that lets positions follow the cache length) does.
    * ``sink`` / ``recent``: the first ``sink`` and the last ``recent`` tokens are never evicted.
    * ``recent_max_fraction``: when set, the recent window is ``min(recent, int(B * fraction))``
      (the EpiKV authors' harness: ``min(128, B // 4)``); ``None`` = ``recent`` as given.
    * ``protect_prompt``: prompt tokens (everything fed, as opposed to generated) are never evicted
      (EpiKV's setting for reasoning).
    * ``prompt_over_budget`` (with ``protect_prompt``): ``"error"`` refuses a prompt that, with the
      sink and recent window, does not fit in B; ``"keep"`` (the EpiKV authors' harness) keeps the
      whole prompt even when it alone exceeds B: the cache then holds max(B, prompt) entries, the
      sink and recent window share what the prompt leaves (most recent first), and a prompt >= B
      leaves nothing, so every generated token is dropped right after its own forward pass.

    On equal scores the engine keeps the more recent position (``runner/engine/cache.py``); the
    protected tiers rank prompt > sink / recent window > any method score.

    Named presets (:data:`PRESETS`, ``protocol: <name>`` in a sweep YAML, ``--protocol <name>`` on the
    CLI): ``epikv_paper`` is everything the EpiKV authors' ``scripts/benchmark.py`` sets for the
    EpiKV family and LagKV: prompt kept whole, recent window ``min(128, B // 4)``, eviction after
    every decode step and never after prefill (a no-op under a kept prompt), positions = cache
    length, no sink, whole-prompt prefill.
        * ``prefill_chunk``: prompts are prefilled in chunks of this many tokens and compressed to B after
      each chunk, so the cache never holds more than B + chunk entries; ``None`` = whole prompt.
    """

    # Each field's metadata is what the CLI flags, the sweep YAML and the lm-eval bridge derive from
    # it: ``help``, ``parse`` (text -> value, for flags and lm-eval's ``model_args``) and pydantic
    # bounds (``ge``/``le``); see :func:`protocol_fields`.
    cadence: str = field(default="every_step", metadata={"help": "every_step or buffer=N", "parse": str})
    positions: Literal["absolute", "compact"] = field(
        default="absolute", metadata={"help": "absolute or compact", "parse": str, "choices": POSITION_MODES})
    sink: int = field(default=0, metadata={"help": "first tokens never evicted", "parse": int, "ge": 0})
    recent: int = field(default=0, metadata={"help": "last tokens never evicted", "parse": int, "ge": 0})
    protect_prompt: bool = field(default=False, metadata={"help": "never evict prompt tokens", "parse": parse_bool})
    prefill_chunk: int | None = field(default=None, metadata={
        "help": "prefill in chunks of this many tokens (default: the whole prompt)", "parse": parse_optional(int), "ge": 1})
    recent_max_fraction: float | None = field(default=None, metadata={
        "help": "cap the recent window at this fraction of the budget", "parse": parse_optional(float), "ge": 0, "le": 1})
    prompt_over_budget: Literal["error", "keep"] = field(default="error", metadata={
        "help": "with protect_prompt, a prompt over the budget: error or keep", "parse": str, "choices": PROMPT_OVER_BUDGET})
    buffer: int = field(init=False, default=0)

    @classmethod
    def from_text(cls, values: dict[str, Any]) -> "Protocol":
        """A protocol from values given as text (lm-eval ``model_args``), each parsed by its field."""
        parsers = {f.name: f.metadata["parse"] for f in protocol_fields()}
        return cls(**{k: parsers[k](v) for k, v in values.items()})

    @classmethod
    def preset(cls, name: str, **overrides) -> "Protocol":
        """The protocol of preset ``name`` (see :data:`PRESETS`), with ``overrides`` on top."""
        if name not in PRESETS:
            raise KvleagueError(f"protocol: unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def recent_for(self, budget: int) -> int:
        """The recent window under budget ``budget``."""
        if self.recent_max_fraction is None:
            return self.recent
        return min(self.recent, int(budget * self.recent_max_fraction))

    def __post_init__(self) -> None:
        if self.cadence == "every_step":
            buffer = 0
        elif self.cadence.startswith("buffer="):
            try:
                buffer = int(self.cadence.split("=", 1)[1])
            except ValueError:
                buffer = -1
            if buffer < 1:
                raise KvleagueError(f"cadence: {self.cadence!r} needs a positive integer N; allowed: {', '.join(CADENCES)}")
        else:
            raise KvleagueError(f"cadence: unknown {self.cadence!r}; allowed: {', '.join(CADENCES)}")
        object.__setattr__(self, "buffer", buffer)
        if self.positions not in POSITION_MODES:
            raise KvleagueError(f"positions: unknown {self.positions!r}; allowed: {', '.join(POSITION_MODES)}")
        for name in ("sink", "recent"):
            if getattr(self, name) < 0:
                raise KvleagueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise KvleagueError(f"prefill_chunk: must be a positive integer or null, got {self.prefill_chunk}")
        if self.recent_max_fraction is not None and not 0 <= self.recent_max_fraction <= 1:
            raise KvleagueError(f"recent_max_fraction: must be in [0, 1] or null, got {self.recent_max_fraction}")
        if self.prompt_over_budget not in PROMPT_OVER_BUDGET:
            raise KvleagueError(
                f"prompt_over_budget: unknown {self.prompt_over_budget!r}; allowed: {', '.join(PROMPT_OVER_BUDGET)}"
            )

    def check_budget(self, budget: int) -> None:
        if budget < 1:
            raise KvleagueError(f"budget: must be a positive integer, got {budget}")
        recent = self.recent_for(budget)
        if self.sink + recent >= budget:
            raise KvleagueError(
                f"budget: {budget} leaves no evictable slot after sink ({self.sink}) + recent ({recent}); "
                f"use a budget > {self.sink + recent}"
            )


def protocol_fields() -> tuple[Field, ...]:
    """The settable fields of :class:`Protocol`, in order: the one list the CLI flags
    (``runner.protocol_args``), the sweep YAML (``runner.sweep_config``), the lm-eval bridge's
    ``model_args`` and the database's ``protocols`` table follow."""
    return tuple(f for f in fields(Protocol) if f.init)


#: named protocols; each value is a complete set of :class:`Protocol` fields
PRESETS: dict[str, dict] = {
    # EpiKV authors' harness (stevenkolawole/epiphany-kv-cache scripts/benchmark.py + the EpiKV family's
    # and LagKVEviction's evict_past_key_values): EvictionConfig(keep_recent_k=128) capped at B // 4,
    # the prompt always kept, eviction after every decode forward, no position_ids (= cache length).
    "epikv_paper": dict(
        cadence="every_step",
        positions="compact",
        sink=0,
        recent=128,
        recent_max_fraction=0.25,
        protect_prompt=True,
        prompt_over_budget="keep",
        prefill_chunk=None,
    ),
}


@dataclass(frozen=True)
class GenerationSettings:
    """Decoding settings. ``temperature == 0`` is greedy decoding."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise KvleagueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise KvleagueError(f"temperature: must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise KvleagueError(f"top_p: must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
