"""A transformers ``DynamicCache`` with slab-backed layers, plus the bookkeeping eviction needs.

For every layer it tracks, slot by slot, the absolute position of the token held there and whether
that token was fed (prompt) or generated. Eviction selects per layer and KV head and **physically
removes** the dropped slots, so memory really shrinks.

One module of ~550 lines on purpose: the slab layer, the protection rules and the top-k selection
share the slot bookkeeping (positions, prompt flags, slot order) that each eviction path updates in
place; split, each half would reach into the other's arrays.

Speed (see ``runner/bench/decode_speed.py``): each layer keeps its keys and values in a preallocated
slab (:class:`SlabLayer`) whose capacity covers the budget plus what one forward pass can add, so a
decode step writes the new entry in place instead of concatenating a new copy of the whole cache,
and an eviction moves only what it must:

* **order-free** (methods with ``Needs.ordered_slots=False``): each dropped slot below the new
  length is refilled with a kept slot from above it, O(evicted) per step;
* **ordered** (the default contract: slots stay in increasing position order): the kept slots after
  the first hole move left in place (a memmove per KV head on the CPU when few slots go, else a
  gather into a reused scratch buffer and back), O(cache after the first hole), with no allocation.

A slab shrinks back to its reserve once a long prompt has been compressed, so memory does shrink.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvleague.engine.contract import CacheView, PerLayer, Phase
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import Protocol

#: growth factor of a slab that must grow past its reserve (amortised O(1) appends without a budget)
_GROWTH = 1.5
_MIN_GROWTH = 256


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
        if not self.is_initialized or self._k.dim() < 2:
            self.lazy_initialization(key_states, value_states)
        n, c = self._nk, key_states.shape[-2]
        if self._nv != n:
            raise KvleagueError(f"cache: keys hold {n} slots but values {self._nv}")
        if n + c > self.capacity:
            self.resize(self._grown(n + c))
        self._k.narrow(-2, n, c).copy_(key_states)
        self._v.narrow(-2, n, c).copy_(value_states)
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
        geometric = max(int(self.capacity * _GROWTH), self.capacity + _MIN_GROWTH)
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
        return self._k, self._v

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


def slab_cache(config, reserve: int | None) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`SlabLayer`\\ s."""
    cache = DynamicCache(config=config)
    cache.layers = [SlabLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class BudgetedCache:
    def __init__(self, config, n_layers: int, n_kv_heads: int, device: torch.device, reserve: int | None = None):
        #: slots a slab is sized for before it grows geometrically (budget + one pass's new tokens)
        self.reserve = reserve
        self.cache = slab_cache(config, reserve)
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.device = device
        # [L, H, T] absolute positions and prompt flags; while ``uniform`` they are one [H, T] row
        # block expanded over the layers, so appends and token-level evictions touch it once
        self._pos = torch.empty(n_kv_heads, 0, dtype=torch.long, device=device)
        self._prompt = torch.empty(n_kv_heads, 0, dtype=torch.bool, device=device)
        self._generated_flag: torch.Tensor | None = None  # a decode step's prompt flags (all False), reused
        self.uniform = True  # every layer and head holds the same tokens (in the same slots)
        self._heads_agree = True  # within each layer, every head does
        #: ``positions`` and ``is_prompt``, each cut when first read after a change
        self._views: list[PerLayer | None] = [None, None]
        self._scratch: torch.Tensor | None = None
        self._scratch_last: tuple[tuple[int, ...], torch.Tensor] | None = None  # the last view of it, by shape
        self.bytes_per_slot = 0
        #: the slabs are rows of a batched slab (engine/decode.py): never reallocate them
        self.pinned = False
        #: whether the last :meth:`evict` was decided by the method's ranking (not by the protocol alone)
        self.ranked = False

    # -- bookkeeping --------------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._pos.shape[-1]

    @property
    def positions(self) -> PerLayer:
        """Per layer ``[H, T]`` absolute positions (fresh tensors after every change: never mutated)."""
        if self._views[0] is None:
            self._views[0] = PerLayer(self._pos, self.n_layers if self.uniform else None)
        return self._views[0]

    @property
    def is_prompt(self) -> PerLayer:
        if self._views[1] is None:
            self._views[1] = PerLayer(self._prompt, self.n_layers if self.uniform else None)
        return self._views[1]

    def _set(
        self, pos: torch.Tensor, prompt: torch.Tensor, uniform: bool, layers: Sequence[torch.Tensor] | None = None
    ) -> None:
        """New bookkeeping; ``layers``: ``pos``'s per-layer tensors cut already (``positions``)."""
        self._pos, self._prompt, self.uniform, self._views = pos, prompt, uniform, [None, None]
        if layers is not None:
            self._views[0] = PerLayer(pos, layers=layers)

    def _per_layer(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[L, H, T]`` positions and flags (a broadcast view while uniform)."""
        if self.uniform:
            shape = (self.n_layers, *self._pos.shape)
            return self._pos.expand(shape), self._prompt.expand(shape)
        return self._pos, self._prompt

    def adopt(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Hold each layer's K and V in ``layers``' tensors (``[1, H, capacity, d]``: rows of a batch's
        slabs, ``decode.py``), holding what the cache holds now (the caller copied it there); they are
        never reallocated from then on (``pinned``). The scratch of its own evictions is let go too (a
        batch's evictions gather for all rows at once)."""
        self.pinned = True
        self._scratch = self._scratch_last = None
        for layer, (keys, values) in zip(self.cache.layers, layers):
            layer.bind(keys, values, self.length)

    def kv_bytes(self) -> int:
        """Bytes of the K/V entries held (slots x layers x heads x head dim x 2 x element size)."""
        if not self.bytes_per_slot:
            self.bytes_per_slot = sum(
                layer.keys.nbytes // max(1, layer.keys.shape[-2])
                + layer.values.nbytes // max(1, layer.values.shape[-2])
                for layer in self.cache.layers
                if layer.is_initialized and layer.keys is not None and layer.keys.dim() >= 2 and layer.keys.shape[-2]
            )
        return self.bytes_per_slot * self.length

    def track(self, new_positions: torch.Tensor, prompt: bool) -> None:
        """Record the slots the last forward pass appended (call right after it)."""
        c = new_positions.shape[0]
        pos = new_positions.to(self.device).expand(*self._pos.shape[:-1], c)
        if c == 1 and not prompt:  # a decode step's: one constant, made once (cat copies it)
            if self._generated_flag is None or self._generated_flag.shape[:-1] != self._prompt.shape[:-1]:
                self._generated_flag = torch.zeros((*self._prompt.shape[:-1], 1), dtype=torch.bool, device=self.device)
            flag = self._generated_flag
        else:
            flag = torch.full((*self._prompt.shape[:-1], c), prompt, dtype=torch.bool, device=self.device)
        self._set(torch.cat([self._pos, pos], dim=-1), torch.cat([self._prompt, flag], dim=-1), self.uniform)

    def view(self, budget: int, phase: Phase, current_position: int) -> CacheView:
        return CacheView(
            layers=self.layer_tensors,
            # read while scoring, before the eviction: the bookkeeping of the cache being scored
            positions=lambda: self.positions,
            is_prompt=lambda: self.is_prompt,
            length=self.length,
            budget=budget,
            phase=phase,
            current_position=current_position,
        )

    def slabs(self) -> torch.Tensor | None:
        """Every layer's K and V as one ``[L, 2, 1, H, capacity, d]`` tensor, where the store keeps them
        so (the slab backend's), else None."""
        return None

    def layer_tensors(self, which: int) -> list[torch.Tensor]:
        """Per layer ``[H, T, d]``: the keys (``which`` 0) or the values (1) held."""
        return [(layer.keys if which == 0 else layer.values)[0] for layer in self.cache.layers]

    def _protected(
        self, pos: torch.Tensor, prompt: torch.Tensor, protocol: Protocol, current_position: int, budget: int
    ) -> torch.Tensor:
        return _window(pos, protocol, current_position, protocol.recent_for(budget)) | (
            prompt if protocol.protect_prompt else False
        )

    def protected(self, protocol: Protocol, current_position: int, budget: int) -> list[torch.Tensor]:
        """Per layer ``[H, T]``: slots the protocol forbids evicting."""
        return [
            self._protected(p, f, protocol, current_position, budget) for p, f in zip(self.positions, self.is_prompt)
        ]

    # -- eviction -------------------------------------------------------------------------------

    def evict(
        self, scores: torch.Tensor, budget: int, protocol: Protocol, current_position: int, ordered: bool = True
    ) -> int:
        """Keep the ``budget`` best slots (protected ones first); return how many slots were dropped.

        A slot the method scores -inf is dropped even when fewer than ``budget`` slots then remain
        (protected slots excepted); every layer and KV head must then keep the same number of slots.
        ``ordered=False`` lets the kept slots change order (see the module docstring)."""
        length = self.length
        scores = self._normalise(scores, length).to(self.device)
        if scores.dim() == 1 and not self.uniform:
            raise KvleagueError("score: per-token scores [T] need every layer and head to hold the same tokens")
        if scores.dim() == 2 and not self.heads_agree:
            scores = scores[:, None, :].expand(self.n_layers, self.n_kv_heads, length)
        pos, prompt = self._ranking_layout(scores.dim())
        window = _window(pos, protocol, current_position, protocol.recent_for(budget))
        prompt_tier = prompt if protocol.protect_prompt else torch.zeros_like(prompt)
        ranked = _tiers(scores, window, prompt_tier)
        # -inf: the method asks for the slot to go even if the cache then holds fewer than B
        keepable = (ranked != float("-inf")).sum(dim=-1)
        # prompt slots, protected slots (most over layers and heads), fewest and most keepable, and
        # whether a score is NaN: one host read
        n_prompt, n_protected, fewest, most, nan = torch.stack(
            [
                prompt_tier.sum(dim=-1).max(),
                (window | prompt_tier).sum(dim=-1).max(),
                keepable.min(),
                keepable.max(),
                torch.isnan(scores).any().long(),
            ]
        ).tolist()
        if nan:
            raise KvleagueError("score: the method returned NaN scores")
        _check_protected(n_protected, budget, protocol)
        # prompt_over_budget "keep": the whole prompt stays even beyond B (then nothing else does)
        kept = max(budget, n_prompt)
        self.ranked = False
        if kept >= length:
            return 0
        if fewest < kept:
            if scores.dim() > 1 and fewest != most:
                raise KvleagueError(
                    "score: -inf (must drop) leaves a different number of slots in different layers or heads; "
                    "every layer and KV head of a cache holds the same number of slots"
                )
            kept = fewest
        self.ranked = _ranking_decided(length, kept, n_protected)
        keep = _keep_top(ranked, kept, pos)  # shape of scores
        budget = kept
        order = self._move_kept(keep, budget, ordered)  # the old slot of every new slot
        if keep.dim() == 1:  # one plan for every layer
            self._set(self._pos[:, order], self._prompt[:, order], True)
        else:
            pos, prompt = self._per_layer()
            index = order[:, None, :].expand(self.n_layers, self.n_kv_heads, budget) if order.dim() == 2 else order
            heads_same, layers_same = _agreement(keep[None]).tolist()
            self._finish(pos.gather(2, index), prompt.gather(2, index), heads_same[0], layers_same[0])
        self._shrink(budget)
        return length - budget

    @property
    def heads_agree(self) -> bool:
        """Within each layer, every KV head holds the same tokens in the same slots."""
        return self.uniform or self._heads_agree

    def _ranking_layout(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and prompt flags in the shape of ``dim``-dimensional scores: ``[T]`` (every layer
        and head agrees), ``[L, T]`` (the heads of each layer agree) or ``[L, H, T]``."""
        if dim == 1:
            return self._pos[0], self._prompt[0]
        pos, prompt = self._per_layer()
        return (pos[:, 0], prompt[:, 0]) if dim == 2 else (pos, prompt)

    def _finish(
        self,
        pos: torch.Tensor,
        prompt: torch.Tensor,
        heads_same: bool,
        layers_same: bool,
        first_layer: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Store per-layer ``[L, H, B]`` bookkeeping after an eviction whose keep masks were equal
        across each layer's heads (``heads_same``) and across the layers (``layers_same``; see
        :func:`_agreement`). Layers (heads) that held the same slots still do when their masks were
        equal; otherwise they are taken to differ from now on. ``first_layer``: a copy of ``pos[0]``
        and ``prompt[0]`` made already (a batch's, made for every row at once)."""
        heads_agree = self.heads_agree and heads_same
        uniform = self.uniform and heads_agree and layers_same
        if uniform:
            self._set(*(first_layer or (pos[0].clone(), prompt[0].clone())), True)
        else:
            self._set(pos, prompt, False)
        self._heads_agree = heads_agree

    def _move_kept(self, keep: torch.Tensor, budget: int, ordered: bool) -> torch.Tensor:
        """Move the kept slots of ``keep`` (``[T]``: every layer's; ``[L, T]`` or ``[L, H, T]``) to the
        first ``budget`` slots of every layer; returns the old slot of every new slot (``[B]``,
        ``[L, B]`` or ``[L, H, B]``)."""
        if keep.dim() == 1:
            plan = _Plan(keep, budget, ordered)
            for layer in self.cache.layers:
                self._evict_layer(layer, plan)
            return plan.order()
        for i, layer in enumerate(self.cache.layers):
            self._evict_layer(layer, _Plan(keep[i], budget, ordered))
        return _row_order(keep, budget, budget, ordered)

    def _evict_layer(self, layer, plan: _Plan) -> None:
        """Physically drop the slots ``plan`` drops from one layer's K/V."""
        budget = plan.budget
        if not isinstance(layer, SlabLayer):  # a layer kind we do not manage: rebuild its tensors
            order = plan.order()
            if order.dim() == 1:
                layer.keys, layer.values = layer.keys.index_select(2, order), layer.values.index_select(2, order)
            else:
                index = order[None, :, :, None]
                layer.keys = layer.keys.gather(2, index.expand(*index.shape[:3], layer.keys.shape[-1]))
                layer.values = layer.values.gather(2, index.expand(*index.shape[:3], layer.values.shape[-1]))
            return
        if not plan.ordered:
            _fill_holes(layer.buffers, plan)
        elif layer.device.type == "cpu" and plan.length - budget <= _MEMMOVE_MAX:
            _shift_left(layer.buffers, plan)
        else:
            self._compact(layer.buffers, plan)
        layer.truncate(budget)

    def _compact(self, buffers, plan: _Plan) -> None:
        """Ordered removal via a scratch buffer: the kept slots after the first hole, gathered, written back."""
        first, tail = plan.tail()
        if tail is None:
            return
        m = tail.shape[-1]
        for buf in buffers:
            live = buf.narrow(-2, 0, plan.length)
            tmp = self._scratch_view(buf, (*buf.shape[:-2], m, buf.shape[-1]))
            if tail.dim() == 1:
                torch.index_select(live, -2, tail, out=tmp)
            else:
                for h in range(tail.shape[0]):
                    torch.index_select(live[:, h], -2, tail[h], out=tmp[:, h])
            buf.narrow(-2, first, m).copy_(tmp)

    def _scratch_view(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """A ``shape`` view of the reused scratch buffer, for a copy of ``like``'s slots; the same view
        as the last call's when the shape is (an eviction's K and V, and its layers, share one)."""
        numel = 1
        for s in shape:
            numel *= s
        s = self._scratch
        if s is None or s.numel() < numel or s.dtype != like.dtype or s.device != like.device:
            self._scratch = s = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self._scratch_last = None
        if self._scratch_last is None or self._scratch_last[0] != shape:
            self._scratch_last = (shape, s[:numel].view(shape))
        return self._scratch_last[1]

    def _shrink(self, budget: int) -> None:
        """Give memory back after a long prompt was compressed: slabs far above the reserve shrink."""
        if self.pinned:
            return
        target = max(self.reserve or budget, budget)
        for layer in self.cache.layers:
            if isinstance(layer, SlabLayer) and layer.capacity > 2 * target:
                layer.resize(target)

    def _normalise(self, scores: torch.Tensor, length: int) -> torch.Tensor:
        """``scores`` checked for type and shape, as a floating tensor where they are (NaN is checked
        with the eviction's one host read)."""
        if not isinstance(scores, torch.Tensor):
            raise KvleagueError(f"score: a method must return a torch.Tensor, got {type(scores).__name__}")
        allowed = {1: (length,), 2: (self.n_layers, length), 3: (self.n_layers, self.n_kv_heads, length)}
        if allowed.get(scores.dim()) != tuple(scores.shape):
            raise KvleagueError(
                f"score: shape {tuple(scores.shape)} is not one of [T]={allowed[1]}, [L, T]={allowed[2]}, [L, H, T]={allowed[3]}"
            )
        return scores if scores.is_floating_point() else scores.float()


def track_rows(caches: list[BudgetedCache], positions: torch.Tensor, rows: list[int]) -> None:
    """``caches[i].track(positions[rows[i]], prompt=False)`` for every cache (a batched decode step's
    one token per row): caches whose bookkeeping has one shape appended with one concatenation for
    all of them, each keeping a view of its row."""
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(caches):
        groups.setdefault((tuple(c._pos.shape), c.device), []).append(i)
    for members in groups.values():
        if len(members) == 1:
            i = members[0]
            caches[i].track(positions[rows[i] : rows[i] + 1], prompt=False)
            continue
        at = [rows[i] for i in members]
        new = (
            positions if at == list(range(positions.shape[0])) else positions[torch.tensor(at, device=positions.device)]
        )
        pos = torch.stack([caches[i]._pos for i in members])  # [m, (L,) H, T]
        prompt = torch.stack([caches[i]._prompt for i in members])
        new = new.to(pos.device).view(-1, *(1,) * (pos.dim() - 1)).expand(*pos.shape[:-1], 1)
        pos = torch.cat([pos, new], dim=-1)
        prompt = torch.cat(
            [prompt, torch.zeros((*prompt.shape[:-1], 1), dtype=torch.bool, device=prompt.device)], dim=-1
        )
        # per-layer bookkeeping: every row's layers cut at once (this step's observation reads them)
        layers = [None] * len(members)
        if pos.dim() == 4:
            cut, n_layers = pos.flatten(0, 1).unbind(0), pos.shape[1]
            layers = [cut[j * n_layers : (j + 1) * n_layers] for j in range(len(members))]
        for i, row_pos, row_prompt, row_layers in zip(members, pos.unbind(0), prompt.unbind(0), layers):
            caches[i]._set(row_pos, row_prompt, caches[i].uniform, row_layers)


def evict_rows(
    caches: list[BudgetedCache],
    scores: list[torch.Tensor],
    budgets: list[int],
    protocol: Protocol,
    current_positions: list[int],
    ordered: bool,
    kv: torch.Tensor,
    rows: list[int],
) -> list[int] | None:
    """:meth:`BudgetedCache.evict` for several caches at once, each the row ``rows[i]`` of the batched
    slabs ``kv`` (every layer's keys and values, ``[L, 2, N, H, capacity, d]``; ``decode.py``), each with
    its own length and budget: one selection over the stacked (padded) scores and one gather for all
    of them (:func:`gather_slots`), and one host read per call whatever the batch size (the rows'
    counts of prompt, protected and keepable slots, which fix how many each keeps). The same kept slots, slot order
    and bookkeeping as evicting each on its own. Returns the dropped count per cache, or None
    (nothing changed) where the rows do not share one plan shape (different score shapes, a row whose
    heads or layers differ where its scores do not, a ``-inf`` score that would leave fewer than the
    budget): the caller then evicts each alone."""
    first = caches[0]
    n = len(caches)
    dim = scores[0].dim()
    if any(x.dim() != dim for x in scores):
        return None
    if (dim == 1 and not all(c.uniform for c in caches)) or (dim == 2 and not all(c.heads_agree for c in caches)):
        return None
    lengths = [c.length for c in caches]
    scores = [c._normalise(x, t) for c, x, t in zip(caches, scores, lengths)]
    if len({(x.device, x.dtype) for x in scores}) > 1:
        return None
    t = max(lengths)

    def padded(tensors: list[torch.Tensor], fill) -> torch.Tensor:
        if all(x.shape[-1] == t for x in tensors):
            return torch.stack(tensors)
        return torch.stack([torch.nn.functional.pad(x, (0, t - x.shape[-1]), value=fill) for x in tensors])

    stacked = padded(scores, float("-inf")).to(first.device)  # [N, (L, (H,)) t]: one copy to the device
    if all(c.uniform for c in caches):  # every cache's positions broadcast over its layers, for the batch at once
        base_pos, base_prompt = (
            padded([c._pos for c in caches], -1),
            padded([c._prompt for c in caches], False),
        )  # [N, H, t]
        if dim == 1:
            pos, prompt = base_pos[:, 0], base_prompt[:, 0]
        else:
            shape = (n, first.n_layers, first.n_kv_heads, t)
            full_pos, full_prompt = base_pos[:, None].expand(shape), base_prompt[:, None].expand(shape)
    else:  # per-layer bookkeeping (dim 2 or 3): every layer's and head's, stacked once for the batch
        per_layer = [c._per_layer() for c in caches]
        full_pos, full_prompt = (
            padded([p for p, _ in per_layer], -1),
            padded([f for _, f in per_layer], False),
        )  # [N, L, H, t]
    if dim > 1:  # the ranking's layout: each layer's first head for [L, T] scores
        pos, prompt = (full_pos[:, :, 0], full_prompt[:, :, 0]) if dim == 2 else (full_pos, full_prompt)
    device = pos.device
    lead = [1] * (pos.dim() - 1)
    # every row's length, newest position and recent window: one copy to the device
    meta = torch.tensor([lengths, current_positions, [protocol.recent_for(b) for b in budgets]], device=device)
    length_t, current, recent = (row.view(n, *lead) for row in meta)
    valid = torch.arange(t, device=device) < length_t
    window = _window(pos, protocol, current, recent) & valid
    prompt_tier = prompt if protocol.protect_prompt else torch.zeros_like(prompt)
    ranked = _tiers(stacked, window, prompt_tier)
    # per row: prompt slots, protected slots (most over layers and heads), fewest keepable, and whether
    # a score is NaN: the one host read
    counts = torch.stack(
        [
            prompt_tier.sum(dim=-1).reshape(n, -1).max(dim=1).values,
            (window | prompt_tier).sum(dim=-1).reshape(n, -1).max(dim=1).values,
            ((ranked != float("-inf")) & valid).sum(dim=-1).reshape(n, -1).min(dim=1).values,
            torch.isnan(stacked).reshape(n, -1).any(dim=1).long(),
        ]
    ).tolist()
    if any(counts[3]):
        raise KvleagueError("score: the method returned NaN scores")
    n_prompt = counts[0] if protocol.protect_prompt else [0] * n
    kept = [max(b, p) for b, p in zip(budgets, n_prompt)]
    if any(keepable < min(k, length) for keepable, k, length in zip(counts[2], kept, lengths)):
        return None  # a -inf score asks for fewer slots than the budget: evict() settles that row by row
    for n_protected, budget in zip(counts[1], budgets):
        _check_protected(n_protected, budget, protocol)
    kept = [min(k, length) for k, length in zip(kept, lengths)]  # a row that keeps all drops nothing
    for c, k, length, n_protected in zip(caches, kept, lengths, counts[1]):
        c.ranked = _ranking_decided(length, k, n_protected)
    if kept == lengths:
        return [0] * n
    k_max = max(kept)
    keep_n = torch.tensor(kept, device=device).view(n, *lead)
    keep = _keep_top(ranked, keep_n, pos)  # [N, (L, (H,)) t]; padding never kept
    order = _row_order(keep, keep_n, k_max, ordered)  # [N, (L, (H,)) k_max]: each row's own plan, padded
    contiguous = rows == list(range(rows[0], rows[0] + n))
    index = None if contiguous else torch.tensor(rows, device=device)
    # every slot before the first dropped one (of any row, layer or head) stays where it is: on a CPU
    # only the slots from there on move (a few, where a method drops recent tokens); on a GPU all move,
    # since reading where that slot is would make the host wait for the device inside the step
    start = _first_dropped(keep) if device.type == "cpu" else 0
    part = kv[:, :, rows[0] : rows[0] + n] if contiguous else kv.index_select(2, index)  # [L, 2, n, H, capacity, d]
    # slots past a row's own count take whatever its padded order names: past its new length
    gather_slots(part, order[..., start:], start, t)
    if not contiguous:  # a copy of the rows: written back
        kv.index_copy_(2, index, part)
    if dim == 1:
        at = order[:, None, :].expand(n, first.n_kv_heads, k_max)
        new_pos, new_prompt = base_pos.gather(2, at), base_prompt.gather(2, at)
        for c, row_pos, row_prompt in zip(caches, _rows(new_pos, kept), _rows(new_prompt, kept)):
            c._set(row_pos, row_prompt, True)
    else:
        at = order[:, :, None, :].expand(n, first.n_layers, first.n_kv_heads, k_max) if order.dim() == 3 else order
        new_pos, new_prompt = full_pos.gather(3, at), full_prompt.gather(3, at)
        heads_same, layers_same = _agreement(keep).tolist()
        # a row that stays uniform keeps a copy of its first layer's: cut for the batch at once
        stays = any(c.uniform and h and l for c, h, l in zip(caches, heads_same, layers_same))
        firsts = zip(_rows(new_pos[:, 0].clone(), kept), _rows(new_prompt[:, 0].clone(), kept)) if stays else [None] * n
        for r, (c, row_pos, row_prompt, first_layer) in enumerate(
            zip(caches, _rows(new_pos, kept), _rows(new_prompt, kept), firsts)
        ):
            c._finish(row_pos, row_prompt, heads_same[r], layers_same[r], first_layer)
    for c, k in zip(caches, kept):
        for layer in c.cache.layers:
            layer.truncate(k)
    return [length - k for length, k in zip(lengths, kept)]


def _rows(padded: torch.Tensor, kept: list[int]) -> Sequence[torch.Tensor]:
    """Row r of ``padded`` (``[N, ..., k_max]``) cut to its ``kept[r]`` slots: one slice and one unbind
    where every row keeps as many (not two views per row)."""
    if len(set(kept)) == 1:
        return padded[..., : kept[0]].unbind(0)
    return [padded[r, ..., :k] for r, k in enumerate(kept)]


def _window(pos: torch.Tensor, protocol: Protocol, current_position, recent) -> torch.Tensor:
    """The sink and recent-window slots (not the prompt); ``current_position`` and ``recent`` are
    numbers, or per-row tensors broadcast against ``pos``."""
    return (pos < protocol.sink) | (pos > current_position - recent)


def _tiers(scores: torch.Tensor, window: torch.Tensor, prompt_tier: torch.Tensor) -> torch.Tensor:
    """What the engine ranks: protected prompt (+inf) > sink / recent window (the largest finite
    value) > the method's scores, capped just below it (its own +inf included); equal scores keep
    the more recent position (:func:`_keep_top`)."""
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    top = torch.finfo(scores.dtype).max
    as_numpy = np.dtype(str(scores.dtype).removeprefix("torch.")).type  # no tensor for the host to read
    below_top = float(np.nextafter(as_numpy(top), as_numpy(0)))
    ranked = torch.where(window, top, scores.clamp(max=below_top))
    return torch.where(prompt_tier, float("inf"), ranked)


def _check_protected(n_protected: int, budget: int, protocol: Protocol) -> None:
    if n_protected > budget and protocol.prompt_over_budget != "keep":
        raise KvleagueError(
            f"budget: {n_protected} protected tokens (sink + recent + prompt) exceed the budget {budget}; "
            "raise the budget, turn off protect_prompt, or use prompt_over_budget: keep"
        )


def _ranking_decided(length: int, kept: int, n_protected: int) -> bool:
    """The method's ranking decided an eviction only when some of its candidates stay and some go;
    otherwise the protocol alone chose (nothing to drop, or every candidate dropped)."""
    return 0 < length - kept < length - n_protected


def _agreement(keep: torch.Tensor) -> torch.Tensor:
    """``[2, N]`` for keep masks ``[N, L, T]`` (the heads of a layer moved alike) or ``[N, L, H, T]``:
    per row, whether every layer's heads kept the same slots, and whether every layer did as the
    first (comparing the masks is cheaper than the positions)."""
    n = keep.shape[0]
    if keep.dim() == 3:
        heads = torch.ones(n, dtype=torch.bool, device=keep.device)
        layers = (keep == keep[:, :1]).reshape(n, -1).all(dim=1)
    else:
        heads = (keep == keep[:, :, :1]).reshape(n, -1).all(dim=1)
        layers = (keep[:, :, 0] == keep[:, :1, 0]).reshape(n, -1).all(dim=1)
    return torch.stack([heads, layers])


def _first_dropped(keep: torch.Tensor) -> int:
    """The earliest slot that any row of keep mask ``keep`` (``[..., T]``) drops: every slot before
    it stays where it is (0 when a row drops none of its ``T`` slots). One host read."""
    return int((~keep).to(torch.uint8).argmax(dim=-1).min())


def _keep_top(ranked: torch.Tensor, kept, positions: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the ``kept`` highest ``ranked`` along the last dim: exactly ``kept`` per row
    (an int, or a tensor broadcast against the leading dims: a count per row).

    Deterministic whatever the slot order: on equal scores the slot holding the larger absolute
    position (``positions``, same shape) is kept. Two stable sorts (by position, then by score) rank
    every slot, so nothing is read on the host and each row may keep its own count."""
    by_position = positions.argsort(dim=-1, descending=True, stable=True)
    order = by_position.gather(-1, ranked.gather(-1, by_position).argsort(dim=-1, descending=True, stable=True))
    t = ranked.shape[-1]
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(t, device=ranked.device).expand_as(order))
    return rank < kept


def _row_order(keep: torch.Tensor, kept, k_max: int, ordered: bool) -> torch.Tensor:
    """``[..., k_max]``: the old slot of each new slot, for a ``[..., T]`` keep mask whose rows keep
    ``kept`` slots (an int, or a count per row broadcast against the leading dims); a row keeping
    fewer than ``k_max`` names arbitrary slots past its count. Ordered: the kept slots in slot order.
    Order-free: slots below the row's count stay, and each dropped one is refilled by a kept slot
    from the count on (in increasing order on both sides). No host read (sorts and scans)."""
    t = keep.shape[-1]
    if ordered:  # the kept slots in slot order
        return keep.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)[..., :k_max]
    # order-free: slots below the row's count stay; its j-th hole there takes its j-th kept slot above
    slots = torch.arange(t, device=keep.device)
    holes = ~keep & (slots < kept)
    donors = keep & (slots >= kept)
    donor_rank = torch.where(donors, donors.long().cumsum(dim=-1) - 1, t)  # t: not a donor (a spare column)
    by_rank = torch.full((*keep.shape[:-1], t + 1), -1, dtype=torch.long, device=keep.device)
    by_rank.scatter_(-1, donor_rank, slots.expand_as(donor_rank))
    hole_rank = (holes.long().cumsum(dim=-1) - 1).clamp(min=0)
    order = torch.where(holes, by_rank.gather(-1, hole_rank), slots.expand_as(hole_rank))
    return order[..., :k_max]


def gather_slots(
    kv: torch.Tensor,
    order: torch.Tensor,
    start: int,
    length: int,
    scratch: Callable[[tuple[int, ...]], torch.Tensor] | None = None,
) -> None:
    """Every layer's K and V at once: in ``kv`` (``[L, 2, N, H, capacity, d]``), slots ``start`` ..
    ``start + w`` of each row take the slots (below ``length``) that ``order`` names: ``[N, w]`` (every
    layer and head alike), ``[N, L, w]`` or ``[N, L, H, w]``. One gather for all layers, or a few
    layers at a time where the gathered copy (into ``scratch(shape)`` if given) would pass
    ``_GATHER_BYTES``."""
    # as [L or 1, 1, N, H or 1, w, 1], broadcast over K / V and head_dim
    if order.dim() == 2:
        at = order[None, None, :, None, :, None]
    elif order.dim() == 3:
        at = order.transpose(0, 1)[:, None, :, None, :, None]
    else:
        at = order.transpose(0, 1)[:, None, :, :, :, None]
    n_layers, _, n, heads, _, head_dim = kv.shape
    width = order.shape[-1]
    chunk = max(1, _GATHER_BYTES // max(2 * n * heads * width * head_dim * kv.element_size(), 1))
    for lo in range(0, n_layers, chunk):
        hi = min(lo + chunk, n_layers)
        slabs, index = (kv, at) if chunk >= n_layers else (kv[lo:hi], at if at.shape[0] == 1 else at[lo:hi])
        index = index.expand(hi - lo, 2, n, heads, width, head_dim)
        out = None if scratch is None else scratch(tuple(index.shape))
        slabs.narrow(-2, start, width).copy_(torch.gather(slabs.narrow(-2, 0, length), -2, index, out=out))


#: ordered removal of at most this many slots per head moves the tail in place (CPU memmove)
_MEMMOVE_MAX = 16
#: the most bytes one gather of the slabs' kept slots copies out (all layers, else a few at a time)
_GATHER_BYTES = 64 << 20


class _Plan:
    """How one layer's slots become the kept ones, for a keep mask ``[T]`` (all heads) or ``[H, T]``.

    Each piece is computed once on demand and shared by the K and V buffers (and, for token-level
    scores, by every layer)."""

    def __init__(self, keep: torch.Tensor, budget: int, ordered: bool):
        self.keep, self.budget, self.ordered = keep, budget, ordered
        self.length = keep.shape[-1]
        self._cache: dict[str, object] = {}

    def order(self) -> torch.Tensor:
        """``[B]`` or ``[H, B]``: the old slot of every new slot."""
        if "order" not in self._cache:
            self._cache["order"] = _row_order(self.keep, self.budget, self.budget, self.ordered)
        return self._cache["order"]

    def gather_index(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The index that gathers a ``shape`` (``[1, H, capacity, d]``) buffer's kept slots into
        ``[1, H, B, d]``: :meth:`order` expanded, shared by every buffer of that shape."""
        key = ("gather", shape)
        if key not in self._cache:
            order = self.order()
            index = order[None, None, :, None] if order.dim() == 1 else order[None, :, :, None]
            self._cache[key] = index.expand(shape[0], shape[1], self.budget, shape[-1])
        return self._cache[key]

    def holes_donors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Order-free: dropped slots below B and the kept slots from B on that refill them.

        ``[k]`` slot indices for a ``[T]`` mask; ``[k, 2]`` (head, slot) pairs for ``[H, T]``."""
        if "holes" not in self._cache:
            b = self.budget
            holes, donors = (~self.keep[..., :b]).nonzero(), self.keep[..., b:].nonzero()
            if self.keep.dim() == 1:
                holes, donors = holes[:, 0], donors[:, 0] + b
            else:
                donors = torch.stack([donors[:, 0], donors[:, 1] + b], dim=1)
            self._cache["holes"] = (holes, donors)
        return self._cache["holes"]

    def drops(self) -> list[list[int]]:
        """Per head (one list when all heads agree): the dropped slots, ascending."""
        if "drops" not in self._cache:
            rows = self.keep.reshape(-1, self.length)
            out: list[list[int]] = [[] for _ in range(rows.shape[0])]
            for r, slot in (~rows).nonzero().tolist():
                out[r].append(slot)
            self._cache["drops"] = out
        return self._cache["drops"]

    def tail(self) -> tuple[int, torch.Tensor | None]:
        """Ordered: the earliest hole over the heads, and the kept slots from it on (``[m]`` / ``[H, m]``)."""
        if "tail" not in self._cache:
            first = _first_dropped(self.keep)
            m = self.budget - first
            tail = None
            if m > 0:
                tail = self.keep[..., first:].nonzero()[:, -1].view(*self.keep.shape[:-1], m) + first
            self._cache["tail"] = (first, tail)
        return self._cache["tail"]


def _fill_holes(buffers, plan: _Plan) -> None:
    """Order-free removal: move each kept slot at or above the budget into a dropped slot below it."""
    holes, donors = plan.holes_donors()
    if not holes.numel():
        return
    for buf in buffers:
        if holes.dim() == 1:
            buf.index_copy_(-2, holes, buf.index_select(-2, donors))
        else:
            b0 = buf[0]  # [H, cap, d]
            b0[holes[:, 0], holes[:, 1]] = b0[donors[:, 0], donors[:, 1]]


def _shift_left(buffers, plan: _Plan) -> None:
    """Ordered removal of a few slots on the CPU: each run of kept slots moves left in place.

    Each KV head's ``[capacity, d]`` block is contiguous, so a run is one overlapping move within
    it; numpy performs overlapping assignments of one-dimensional contiguous arrays as a memmove."""
    drops, length = plan.drops(), plan.length
    for buf in buffers:
        raw = buf.view(torch.uint8).numpy()[0]  # [H, cap, row bytes], sharing the slab's memory
        width = raw.shape[-1]
        for h in range(raw.shape[0]):
            flat = raw[h].reshape(-1)
            dropped = drops[0] if len(drops) == 1 else drops[h]
            for s, j in enumerate(dropped):
                end = dropped[s + 1] if s + 1 < len(dropped) else length
                if end > j + 1:
                    flat[(j - s) * width : (end - 1 - s) * width] = flat[(j + 1) * width : end * width]
