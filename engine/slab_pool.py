"""Slabs kept for reuse, so that a captured decode step replays for the next sequences of a shape.

A CUDA graph reads and writes the slabs at the addresses it was captured over (``slab.py``): new
slabs for every session or batch mean a capture per session, and every capture drains the device.
The slab backend therefore takes its slabs from a :class:`SlabPool` keyed by (shape, dtype, device)
and gives them back when their owner lets go of them: a sequence's own store when it dies, grows or
is copied into a batch's row; a batch's slabs when its decode loop ends or rebuilds them. The next
owner of a slab gets it zeroed, as a fresh one, so nothing of its last owner is visible.

A batch's sequences stay bound to their rows when the loop ends (a multi-turn sequence goes on
from there). Such a slab goes back with its *tenants*: a tenant still alive and still bound to it
when another owner takes the slab is first moved to slabs of its own (``SlabStore.move_out``); a
sequence that was let go costs nothing. The pool holds at most ``per_shape`` free slabs of each of
its ``shapes`` most recent shapes, the ones given back first (one slab a shape by default: the one
a graph was captured over keeps being handed out, where several sequences of a batch, each fed on
slabs of its own, give theirs back together); :meth:`SlabPool.clear` lets them all go.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

import torch


class Tenant(Protocol):
    def move_out(self, slab: torch.Tensor) -> None:
        """Stop using ``slab`` (copy what it holds of this tenant to memory of its own), if it still does."""


class SlabPool:
    def __init__(self, per_shape: int = 1, shapes: int = 8):
        self.per_shape, self.shapes = per_shape, shapes
        self._free: OrderedDict[tuple, list[tuple[torch.Tensor, list[weakref.ref]]]] = OrderedDict()
        #: slabs asked for, and how many of them were a slab given back (what a run reuses)
        self.taken = self.reused = 0

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A zeroed slab of ``shape`` with ``like``'s dtype and device: one given back, else a new one."""
        self.taken += 1
        free = self._free.get(_key(shape, like))
        if not free:
            return like.new_zeros(shape)
        slab, tenants = free.pop()
        if slab.is_inference() and not torch.is_inference_mode_enabled():
            return like.new_zeros(shape)  # made under inference mode: not writable outside it
        for ref in tenants:
            tenant = ref()
            if tenant is not None:
                tenant.move_out(slab)
        self.reused += 1
        return slab.zero_()

    def give(self, slab: torch.Tensor, tenants: Iterable[Tenant] = ()) -> None:
        """``slab`` is free for the next :meth:`take` of its shape (``tenants``: what may still read it)."""
        key = _key(tuple(slab.shape), slab)
        free = self._free.setdefault(key, [])
        self._free.move_to_end(key)
        if len(free) < self.per_shape and all(s is not slab for s, _ in free):
            free.append((slab, [weakref.ref(t) for t in tenants]))
        while len(self._free) > self.shapes:
            self._free.popitem(last=False)

    def clear(self) -> None:
        self._free.clear()

    def describe(self) -> dict[str, int]:
        return {"slabs_taken": self.taken, "slabs_reused": self.reused}


def _key(shape: tuple[int, ...], like: torch.Tensor) -> tuple:
    return (shape, like.dtype, like.device)
