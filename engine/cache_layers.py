"""The Hugging Face cache layers the budgeted cache keeps its K/V in: :class:`SlabLayer`, a
``DynamicLayer`` over a preallocated slab whose capacity covers the budget plus what one forward pass
can add, so a decode step writes the new entry in place instead of concatenating a new copy of the
whole cache; and :func:`slab_cache`, a ``DynamicCache`` of them."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvleague.engine.errors import KvleagueError

#: growth factor of a slab that must grow past its reserve (amortised O(1) appends without a budget)
GROWTH = 1.5
MIN_GROWTH = 256


class SlabLayer(DynamicLayer):
    """A ``DynamicLayer`` whose K/V live in a preallocated ``[B, H, capacity, d]`` buffer.

    ``keys`` / ``values`` are views of the first ``length`` slots, so every reader of a
    ``DynamicLayer`` sees what it expects; assigning a tensor to them (as kvpress, beam search or
    offloading do) adopts that tensor as the new buffer. ``update`` appends in place and grows the
    buffer only past its capacity (to ``reserve`` first, then geometrically).
    """

    def __init__(self, reserve: int | None = None):
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._nk = self._nv = 0
        self._kview: torch.Tensor | None = None
        self._vview: torch.Tensor | None = None
        self.reserve = reserve
        super().__init__()

    # -- DynamicLayer's attributes, as views of the slab ----------------------------------------

    @property
    def keys(self) -> torch.Tensor | None:
        if self._kview is None and self._k is not None:  # built on first read: a decode step moves the length of
            self._kview = self._k.narrow(-2, 0, self._nk)  # every row's layers, and few of them are read
        return self._kview

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._k, self._nk = tensor, (0 if tensor is None or tensor.dim() < 2 else tensor.shape[-2])
        self._kview = tensor

    @property
    def values(self) -> torch.Tensor | None:
        if self._vview is None and self._v is not None:
            self._vview = self._v.narrow(-2, 0, self._nv)
        return self._vview

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._v, self._nv = tensor, (0 if tensor is None or tensor.dim() < 2 else tensor.shape[-2])
        self._vview = tensor

    @property
    def capacity(self) -> int:
        return 0 if self._k is None or self._k.dim() < 2 else self._k.shape[-2]

    def _refresh(self) -> None:
        self._kview = self._vview = None  # the views of the new length, built when read

    # -- the cache-layer interface --------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._k = key_states.new_empty((*key_states.shape[:-2], 0, key_states.shape[-1]))
        self._v = value_states.new_empty((*value_states.shape[:-2], 0, value_states.shape[-1]))
        self._nk = self._nv = 0
        self._refresh()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
        if not self.is_initialized or self._k is None or self._k.dim() < 2:
            self.lazy_initialization(key_states, value_states)
        n, c = self._nk, key_states.shape[-2]
        if self._nv != n:
            raise KvleagueError(f"cache: keys hold {n} slots but values {self._nv}")
        if n + c > self.capacity:
            self.resize(self._grown(n + c))
        k, v = self.buffers
        k.narrow(-2, n, c).copy_(key_states)
        v.narrow(-2, n, c).copy_(value_states)
        self._nk = self._nv = n + c
        self._refresh()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._nk if self.is_initialized else 0

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.get_seq_length() - abs(max_length)
        if self.get_seq_length() > max_length:
            self.truncate(max_length)

    # -- what eviction uses ---------------------------------------------------------------------

    def _grown(self, needed: int) -> int:
        geometric = max(int(self.capacity * GROWTH), self.capacity + MIN_GROWTH)
        if self.reserve is not None:
            geometric = min(geometric, self.reserve)
        return max(needed, geometric)

    #: free slots zeroed on allocation (a store that attends over them masked needs it: 0 x NaN is NaN)
    zeroed = False

    def resize(self, capacity: int) -> None:
        """Reallocate the slab to ``capacity`` slots (>= length), keeping the held ones."""
        n = self._nk
        for name in ("_k", "_v"):
            old = getattr(self, name)
            shape = (*old.shape[:-2], capacity, old.shape[-1])
            new = old.new_zeros(shape) if self.zeroed else old.new_empty(shape)
            new.narrow(-2, 0, n).copy_(old.narrow(-2, 0, n))
            setattr(self, name, new)
        self._refresh()

    def truncate(self, length: int) -> None:
        self._nk = self._nv = length
        self._refresh()

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The slabs, once allocated (``lazy_initialization``, ``bind`` or an assignment)."""
        k, v = self._k, self._v
        assert k is not None and v is not None, "cache layer read before its first update"
        return k, v

    def bind(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Adopt ``keys`` / ``values`` (``[1, H, capacity, d]``, e.g. one row of a batched slab) as the
        buffers, holding ``length`` slots; writes go to the caller's tensors from now on."""
        self._k, self._v = keys, values
        self.set_length(length)
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def set_length(self, length: int) -> None:
        """The buffers hold ``length`` slots (someone else, the batched cache, wrote the new ones)."""
        self._nk = self._nv = length
        self._refresh()


def held(tensor: torch.Tensor | None) -> torch.Tensor:
    """A cache layer's keys or values, which Hugging Face types as optional: set once the layer holds
    a forward pass's entries (every reader here comes after one)."""
    assert tensor is not None, "cache layer read before its first update"
    return tensor


def slab_cache(config, reserve: int | None) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`SlabLayer`\\ s."""
    cache = DynamicCache(config=config)
    cache.layers = [SlabLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
