"""Run settings that must be identical for every method compared in one cell group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from runner.errors import KvleagueError

CADENCES = ("every_step", "buffer=N")
POSITION_MODES = ("absolute", "compact")


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
    * ``protect_prompt``: prompt tokens (everything fed, as opposed to generated) are never evicted
      (EpiKV's setting for reasoning). A prompt longer than the budget is then an error.
    * ``prefill_chunk``: prompts are prefilled in chunks of this many tokens and compressed to B after
      each chunk, so the cache never holds more than B + chunk entries; ``None`` = whole prompt.
    """

    cadence: str = "every_step"
    positions: Literal["absolute", "compact"] = "absolute"
    sink: int = 0
    recent: int = 0
    protect_prompt: bool = False
    prefill_chunk: int | None = None
    buffer: int = field(init=False, default=0)

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

    def check_budget(self, budget: int) -> None:
        if budget < 1:
            raise KvleagueError(f"budget: must be a positive integer, got {budget}")
        if self.sink + self.recent >= budget:
            raise KvleagueError(
                f"budget: {budget} leaves no evictable slot after sink ({self.sink}) + recent ({self.recent}); "
                f"use a budget > {self.sink + self.recent}"
            )


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
