"""Process peak-memory accounting for one generation: CUDA max-allocated on GPU, RSS on CPU."""

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

    def sample(self) -> None:
        if not self.cuda:
            self._peak = max(self._peak, current_rss())

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
