"""What a generation costs: process peak memory (CUDA max-allocated on GPU, RSS on CPU), the engine's
clocks, and the intervals inside a decode step timed without making the host wait."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss() -> int:
    """Resident set size in bytes (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


class PeakMemory:
    """Peak memory of one generation.

    On CUDA: ``torch.cuda.max_memory_allocated`` after a reset at start (exact). On CPU the kernel's
    RSS high-water mark is per process and cannot be reset here, so RSS is sampled after every
    forward pass and eviction; transient peaks inside a forward pass are not seen (``source`` says so).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.source = "cuda_max_allocated" if self.cuda else "rss_sampled_per_step"
        self._peak = 0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._peak = 0 if self.cuda else current_rss()

    def sample(self, rss: int | None = None) -> None:
        """Take an RSS sample (``rss``: one the caller read just now, shared by a batch's sequences)."""
        if not self.cuda:
            self._peak = max(self._peak, current_rss() if rss is None else rss)

    @property
    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else self._peak


def device_clock(device: torch.device) -> Callable[[], float]:
    """``time.perf_counter`` that first waits for the work queued on ``device``: CUDA kernels run
    asynchronously, so an unsynchronized clock would time their launch, not their work."""
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


class Spans:
    """A sum of weighted intervals between two marks (:meth:`Engine.mark`: numbers off the engine's
    clock, or CUDA events recorded on the stream). Events are read only when the sum is read (or,
    to bound what is held, once enough of them have completed), so timing the method's share of a
    decode step never makes the host wait for the device inside the step."""

    #: pending event pairs past which the completed ones are folded into the sum
    FOLD_AT = 512

    def __init__(self) -> None:
        self._total = 0.0
        self._events: list[tuple] = []

    def add(self, start, end, weight: float = 1.0) -> None:
        if isinstance(start, float):
            self._total += (end - start) * weight
            return
        self._events.append((start, end, weight))
        if len(self._events) >= self.FOLD_AT:
            done, pending = [], []
            for pair in self._events:
                (done if pair[1].query() else pending).append(pair)
            self._fold(done)
            self._events = pending

    def _fold(self, events) -> None:
        self._total += sum(start.elapsed_time(end) * weight for start, end, weight in events) / 1e3

    @property
    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()  # events complete in stream order
            self._fold(self._events)
            self._events = []
        return self._total
