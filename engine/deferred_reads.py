"""Device values the host needs, but not at once: read in the same copy as the next read the host
makes anyway.

On a GPU every read of a device value (``.tolist()``, ``.item()``) makes the host wait until the
device has caught up. A greedy decode step must read its tokens (the stop test); an eviction's
checks (a NaN score, too many protected tokens, a ``-inf`` score from a method that did not say it
keeps fewer than B), its ``ranked`` flag and whether its layers' and heads' keep masks agreed are
needed only later. :meth:`DeferredReads.post` holds such a value with what to do with it;
:meth:`DeferredReads.read` reads a tensor the host needs now and everything posted in one copy, then
runs the callbacks. The decode loop posts its steps' evictions here, reads its tokens through it, and flushes it
before its next step and at its end, so a greedy step makes one read, and what a callback
changes has changed only by appends since it was posted. Anywhere else (:func:`post` with none
active: a prompt's evictions) a posted value is read at once.

A method may post what it observes at a decode step (:func:`post_floats`) where the step's newest
tokens' own scores are all that waits on it: the loop takes such posts only where the protocol's
recent window protects those tokens at the step's own eviction, so their scores are first ranked
after the read (the EpiKV family's and KV-key / KV-val's frozen scores).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch

Then = Callable[[list[int]], None]

_active: ContextVar[DeferredReads | None] = ContextVar("kvleague_deferred_reads", default=None)


class DeferredReads:
    """What was posted since the last read: ``(values, then)``, each ``values`` a 1-D integer tensor."""

    def __init__(self) -> None:
        self._posted: list[tuple[torch.Tensor, Then]] = []
        #: host reads made (a flush with nothing posted makes none)
        self.reads = 0

    @property
    def pending(self) -> bool:
        return bool(self._posted)

    def post(self, values: torch.Tensor, then: Then) -> None:
        self._posted.append((_flat(values), then))

    def read(self, now: torch.Tensor) -> list[int]:
        """``now.tolist()`` (a 1-D integer tensor), everything posted read in the same copy; the
        callbacks run after, in the order posted (one may raise: the error an eager read would have
        raised at its eviction)."""
        posted, self._posted = self._posted, []
        if not posted:
            self.reads += 1
            return now.tolist()
        parts = [_flat(now), *(v if v.device == now.device else v.to(now.device) for v, _ in posted)]
        values = torch.cat(parts).tolist()
        self.reads += 1
        cut = parts[0].numel()
        head, at = values[:cut], cut
        for v, then in posted:
            then(values[at : at + v.numel()])
            at += v.numel()
        return head

    def flush(self) -> None:
        """Read everything posted (nothing to read: no read)."""
        if self._posted:
            self.read(torch.zeros(0, dtype=torch.long, device=self._posted[0][0].device))

    @contextmanager
    def active(self) -> Iterator[DeferredReads]:
        """Posts inside go to this one, read at its next :meth:`read` or :meth:`flush`."""
        token = _active.set(self)
        try:
            yield self
        finally:
            _active.reset(token)


@contextmanager
def now() -> Iterator[None]:
    """Posts inside are read at once, whatever is active (a method that ranks what it posts at the
    step's own eviction)."""
    token = _active.set(None)
    try:
        yield
    finally:
        _active.reset(token)


def _flat(values: torch.Tensor) -> torch.Tensor:
    """``values`` as a 1-D integer tensor (no op where it is one)."""
    values = values if values.dim() == 1 else values.reshape(-1)
    return values if values.dtype == torch.long else values.long()


def post_floats(values: torch.Tensor, then: Callable[[np.ndarray], None]) -> None:
    """:func:`post` of float64 ``values``: ``then`` gets them as a float64 array of ``values``' shape,
    every bit as on the device (carried as int64 in the one copy)."""
    values = values.to(torch.float64).contiguous()
    shape = tuple(values.shape)
    post(values.view(torch.int64), lambda bits: then(np.array(bits, dtype=np.int64).view(np.float64).reshape(shape)))


def post(values: torch.Tensor, then: Then) -> None:
    """Post ``values`` to the active :class:`DeferredReads`, or read them now where none is active."""
    reads = _active.get()
    if reads is None:
        then(_flat(values).tolist())
    else:
        reads.post(values, then)
