"""The slab backend: fixed-size KV slabs compacted in place, attention over the whole slab under a
validity mask, and decode steps that can be captured as CUDA graphs (``BACKENDS``: ``"slab"``).

It runs the same Hugging Face model as :class:`~engine.backend.HFBackend` and the same engine
loops (``session.py``, ``decode.py``: track, observe, score, select); what differs is the KV store
and the forward pass:

* **Fixed slabs.** Per layer, K and V are one ``[batch, kv_heads, capacity, head_dim]`` buffer each,
  views of one ``[layers, 2, batch, kv_heads, capacity, head_dim]`` tensor (``SlabStore.kv``; a
  batch's ``DecodeLoop.kv``), allocated zeroed once at ``capacity`` = budget + what one pass appends (the prefill chunk, or the
  cadence's buffer + 1; a prefill longer than that sizes it to the prompt, and the eviction that
  compresses the prompt takes it back to that reserve; a budget past the model's context, i.e. no
  eviction, is sized for the whole decode when it starts, ``SlabStore.expect``, and grows
  geometrically past that). Lengths and absolute positions are device tensors
  (``BudgetedCache``'s bookkeeping); a decode step's eviction never reallocates the slab.
* **Compaction in place.** An eviction moves the kept slots of every layer's K and V to the front
  with one gather (``compaction.gather_slots``: into a reused scratch, then one copy back; a few layers at
  a time where the copy would pass 64 MiB): the same slot layout the HF store's memmove / hole
  filling produce (``_Plan.order``), so the two backends hold the same entries in the same slots.
  On CUDA (``reorders_slots``) a method declaring ``Needs.order_free_scores`` is evicted as an
  order-free one (holes filled from the top: at most the evicted slots move), where ``hf`` keeps the
  position order its references keep.
* **Constant shapes.** Every forward attends over the whole slab (``capacity`` keys) with a 4D mask
  (slot visible iff valid and causally before the query), built here on the device from the start
  slot and the decode loop's padding mask; HF's own mask logic, which synchronizes with the host, is
  bypassed. A decode step therefore has the same shapes whatever the cache holds.
* **CUDA graphs** (:class:`GraphedStep`, only on CUDA): every decode step is captured once per
  (batch, capacity, kernel, observed layers, slab addresses) and replayed: tokens, RoPE positions,
  write slots and the mask are static device buffers filled before each replay; K/V are written at
  device-held slots. The graph holds no slab, only its key their addresses; slabs come from the
  backend's pool (``slab_pool.py``), so the next session or batch of a shape gets a finished one's
  slabs and replays its graphs (up to ``max_graphs`` kept, sharing one CUDA memory pool). What a
  method observes inside the step (hidden states, queries, new K/V, attention weights) is tapped
  during the capture (:class:`_Tap`): the tapped tensors live in the graph's memory, each replay
  rewrites them, and after it the backend hands copies to the hooks and the recorder that asked, so
  every method's steps are captured. Prefill and every step on the CPU run eagerly;
  :meth:`SlabBackend.describe` counts which path ran (``decode_steps``: ``eager`` / ``graph`` /
  ``static``) and the captures with their seconds. The method's scoring and the engine's top-k
  selection run eagerly between steps on either path (for a method that never scores -inf without
  a host read: ``deferred_reads.py``).

Methods that read attention rows get them from the attention wrapper (``probe.py``) over the valid
slots of the slab (``AttentionRecorder.kv_length``, ``BatchAttentionRecorder``'s per-row lengths).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from kvleague.engine import slab_attention
from kvleague.engine.backend import HFBackend
from kvleague.engine.cache import BudgetedCache
from kvleague.engine.cache_layers import GROWTH, MIN_GROWTH, SlabLayer
from kvleague.engine.compaction import fill_slab_holes, gather_slots, row_order
from kvleague.engine.decode import BatchSlabLayer
from kvleague.engine.eager import Rows
from kvleague.engine.errors import KvleagueError
from kvleague.engine.probe import AttentionRecorder, active_recorder, recording
from kvleague.engine.resources import device_clock
from kvleague.engine.slab_pool import SlabPool


class FixedSlabLayer(SlabLayer):
    """One sequence's layer: a zeroed ``[1, H, capacity, d]`` slab; ``update`` writes the new entries
    in place and returns the **whole** slab (the mask hides the free slots)."""

    #: device-held write slot ``[1]`` of a captured step (None: write at the host-known length)
    slots: torch.Tensor | None = None
    #: free slots are attended over (masked), and 0 x NaN garbage would still be NaN
    zeroed = True
    #: the store's reallocation of every layer at once (``SlabStore._grow``, False: this layer alone),
    #: held weakly: a store is freed (and its slabs go back to the pool) when its last user lets go,
    #: not at the next cycle collection
    grow_all: weakref.WeakMethod | None = None

    def resize(self, capacity: int) -> None:
        grow_all = self.grow_all() if self.grow_all is not None else None
        if grow_all is None or not grow_all(capacity, self.buffers[0]):
            super().resize(capacity)

    def planned(self, needed: int) -> int:
        """The capacity a pass that needs ``needed`` slots runs at: the current one while it fits; the
        reserve (budget + one pass) or the first prompt, whichever is larger, at first; past that
        (a method that never evicts) geometric growth, as the HF store's."""
        if needed <= self.capacity:
            return self.capacity
        if self.capacity == 0:
            return max(self.reserve or 0, needed)
        return max(needed, int(self.capacity * GROWTH), self.capacity + MIN_GROWTH)  # (a budget past the context)

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.planned(self.get_seq_length() + cache_position.shape[0]), 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
        if not self.is_initialized or self._k is None or self._k.dim() < 2:
            self.lazy_initialization(key_states, value_states)
        n, c = self._nk, key_states.shape[-2]
        if n + c > self.capacity:
            self.resize(self.planned(n + c))
        k, v = self.buffers
        if self.slots is not None:  # captured: the slot comes from a device buffer
            k.index_copy_(2, self.slots, key_states)
            v.index_copy_(2, self.slots, value_states)
            return k, v
        k.narrow(-2, n, c).copy_(key_states)
        v.narrow(-2, n, c).copy_(value_states)
        self._nk = self._nv = n + c
        self._refresh()
        return k, v


class FixedBatchSlabLayer(BatchSlabLayer):
    """A batched decode step's layer (``decode.py``): as :class:`BatchSlabLayer`, but attention sees
    the whole ``[N, H, capacity, d]`` slab under the backend's mask."""

    #: device-held write slot per row ``[N]`` of a captured step (None: ``rows``' host-side rule)
    slots: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
        if self.slots is not None:
            rows = torch.arange(self.slab_k.shape[0], device=self.slab_k.device)
            self.slab_k[rows, :, self.slots] = key_states[:, :, 0]
            self.slab_v[rows, :, self.slots] = value_states[:, :, 0]
        else:
            super().update(key_states, value_states, cache_kwargs)
        return self.slab_k, self.slab_v


class SlabStore(BudgetedCache):
    """The budgeted cache over fixed slabs: ``BudgetedCache``'s bookkeeping and selection, no shrinking.
    Every layer's K and V are views of one ``[L, 2, 1, H, capacity, d]`` tensor (``kv``), grown
    together, so an eviction moves the kept slots of all layers with one gather."""

    def __init__(
        self,
        config,
        n_layers: int,
        n_kv_heads: int,
        device: torch.device,
        reserve: int | None = None,
        pool: SlabPool | None = None,
    ):
        super().__init__(config, n_layers, n_kv_heads, device, reserve)
        #: where its slabs come from and go back to (the backend's): a captured step replays over them
        self.pool = pool
        self._give_back: weakref.finalize | None = None  # the slabs go back to the pool when the store dies
        cache = DynamicCache(config=config)
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise KvleagueError(
                "backend slab: every layer must be a full-attention layer (no sliding-window cache); use backend hf"
            )
        limit = getattr(config, "max_position_embeddings", None)
        if reserve is not None and limit is not None and reserve > limit:
            reserve = None  # a budget past the model's context (no eviction): the slab grows as it fills
        layers: list[CacheLayerMixin] = [FixedSlabLayer(reserve) for _ in cache.layers]
        cache.layers = layers
        self.cache = cache
        for layer in self.slab_layers:
            layer.grow_all = weakref.WeakMethod(self._grow)
        self.kv: torch.Tensor | None = None
        self._kv_views: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _grow(self, capacity: int, like: torch.Tensor, fresh: bool = False) -> bool:
        """Reallocate every layer's slabs as views of one tensor of ``capacity`` slots (from the pool,
        unless ``fresh``), keeping what they hold; False (nothing done) where a layer's shape differs
        from ``like``'s (``[1, H, *, d]``). The slabs it held of its own go back to the pool."""
        layers = self.slab_layers
        shape = (*like.shape[:-2], like.shape[-1])
        if any(
            layer._k is not None and layer._k.dim() == 4 and (*layer._k.shape[:-2], layer._k.shape[-1]) != shape
            for layer in layers
        ):
            return False
        size = (len(layers), 2, *like.shape[:-2], capacity, like.shape[-1])
        kv = self.pool.take(size, like) if self.pool is not None and not fresh else like.new_zeros(size)
        for l, layer in enumerate(layers):
            n = layer._nk if layer.is_initialized and layer._k is not None and layer._k.dim() == 4 else 0
            if n:
                k, v = layer.buffers
                kv[l, 0].narrow(-2, 0, n).copy_(k.narrow(-2, 0, n))
                kv[l, 1].narrow(-2, 0, n).copy_(v.narrow(-2, 0, n))
            layer.bind(kv[l, 0], kv[l, 1], n)
        self._own(kv)
        self._kv_views = [layer.buffers for layer in layers]
        self.pinned = False
        return True

    def _own(self, kv: torch.Tensor | None) -> None:
        """Hold ``kv`` (or none) as its own slabs; the ones it held go back to the pool, as ``kv`` will
        when the store dies."""
        old, self.kv = self.kv, kv
        if self._give_back is not None:
            self._give_back.detach()
            self._give_back = None
        if self.pool is None:
            return
        if old is not None and old is not kv:
            self.pool.give(old)
        if kv is not None:
            self._give_back = weakref.finalize(self, self.pool.give, kv)

    def move_out(self, slab: torch.Tensor) -> None:
        """Copy what this store holds in ``slab`` (rows of a finished batch's slabs it is still bound
        to, which the pool hands to a new owner) to slabs of its own (``SlabPool.take``)."""
        first = self.slab_layers[0]
        if not first.is_initialized or first._k is None:
            return
        if first._k.untyped_storage().data_ptr() != slab.untyped_storage().data_ptr():
            return
        self._grow(first.capacity, first._k, fresh=True)

    @property
    def slab_layers(self) -> list[FixedSlabLayer]:
        return cast("list[FixedSlabLayer]", self.cache.layers)  # __init__ made every layer one

    def adopt(self, layers) -> None:
        """As ``BudgetedCache.adopt``; the slabs of its own are let go (a finished sequence of a
        continuous batch would otherwise keep its prefill's slabs until the batch ends)."""
        super().adopt(layers)
        self._own(None)
        self._kv_views = []

    def slabs(self) -> torch.Tensor | None:
        """``kv`` while every layer's slabs are still its views (a batched decode rebinds them to its
        own slabs' rows), else None."""
        kv = self.kv
        if kv is None or any(layer._k is not k for layer, (k, _) in zip(self.slab_layers, self._kv_views)):
            return None
        return kv

    def layer_tensors(self, which: int) -> list[torch.Tensor]:
        """Every layer's keys or values cut from ``kv`` with one op (not two per layer)."""
        kv = self.slabs()
        if kv is None:
            return super().layer_tensors(which)
        return list(kv[:, which, 0, :, : self.slab_layers[0]._nk].unbind(0))

    def _move_kept(self, keep: torch.Tensor, budget: int, ordered: bool) -> torch.Tensor:
        """One gather for every layer's K and V (the HF store's slot layout), while every layer's slabs
        are still the views of ``kv`` (a batched decode rebinds them to its own slabs' rows)."""
        kv = self.slabs()
        if kv is None:
            return super()._move_kept(keep, budget, ordered)
        order = row_order(keep, budget, budget, ordered)  # [B], [L, B] or [L, H, B]
        if ordered:
            gather_slots(
                kv, order[None], 0, keep.shape[-1], lambda shape: self._scratch_view(kv, shape)
            )  # a batch of one
        else:  # the holes below the budget alone take the kept slots above it
            fill_slab_holes(kv, keep[None], budget, keep.shape[-1] - budget)
        for layer in self.slab_layers:
            layer.truncate(budget)
        return order

    def _evict_layer(self, layer, plan) -> None:
        for buf in layer.buffers:  # [1, H, capacity, d]
            index = plan.gather_index(tuple(buf.shape))  # the HF store's slot layout; one per plan and shape
            tmp = self._scratch_view(buf, tuple(index.shape))
            torch.gather(buf, -2, index, out=tmp)
            buf.narrow(-2, 0, plan.budget).copy_(tmp)
        layer.truncate(plan.budget)

    def expect(self, slots: int) -> None:
        """Every layer's slabs grown once to ``slots`` where they hold fewer: a captured step reads its
        whole slab, and is captured per capacity, so a decode that never evicts runs at one capacity
        that fits it (its prompt and every new token) rather than growing by half again as it fills."""
        first = self.slab_layers[0]
        if self.slabs() is not None and first.capacity < slots:
            self._grow(slots, first.buffers[0])

    def _shrink(self, budget: int) -> None:
        """A slab sized to a long prompt goes back to its reserve (budget + one pass) once the prompt
        is compressed, before any decode step: every decode step reads the whole slab where one
        length does not serve (a captured step), and a step is captured per capacity. Rows of a
        batch's slabs are never reallocated."""
        kv, first = self.slabs(), self.slab_layers[0]
        reserve = first.reserve
        if kv is not None and reserve is not None and kv.shape[-2] > max(reserve, budget):
            self._grow(max(reserve, budget), first.buffers[0])


class SlabBackend(HFBackend):
    """Hugging Face's model over fixed KV slabs (see the module docstring)."""

    name = "slab"

    def __init__(self, model, tokenizer, attn_implementation: str = "sdpa", graphs: bool | None = None):
        if attn_implementation not in ("sdpa", "eager"):
            raise KvleagueError(
                f"backend slab: attn_implementation {attn_implementation!r} takes no 4D mask; allowed: sdpa, eager"
            )
        super().__init__(model, tokenizer, attn_implementation)
        #: capture decode steps as CUDA graphs (default: on CUDA only; True on the CPU runs the captured
        #: body eagerly, so its static-buffer writes and mask are checked without a GPU)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        #: order-free scores evicted by filling holes (``Needs.order_free_scores``): on CUDA, where its
        #: kernels part from ``hf``'s float bits anyway; off CUDA the order is kept (``hf``'s bits, tested)
        self.reorders_slots = self.device.type == "cuda"
        #: eager attention (methods declaring ``Needs.eager``) of a decode step in the KV heads as they
        #: are, not repeated per query head (``slab_attention.attend_eager``): on CUDA, whose kernels
        #: part from ``hf``'s float bits anyway; off CUDA transformers' kernel (``hf``'s bits, tested)
        self.grouped_eager = self.device.type == "cuda"
        #: decode steps per path: ``eager`` (dynamic), ``graph`` (a CUDA graph replayed), ``static`` (the
        #: graph's body run eagerly over its static buffers: ``graphs=True`` off CUDA, for tests)
        self.steps = {"eager": 0, "graph": 0, "static": 0}
        #: graphs captured (off CUDA: captured bodies first run) and the seconds their warm-up and
        #: capture took, device synchronized around them: what a run pays once per new shape or slab
        self.captures, self.capture_seconds = 0, 0.0
        #: the (batch, capacity) shapes captured: a run captures each once at best
        self.capture_shapes: set[tuple[int, int]] = set()
        #: the hidden-state callbacks of the ``observing`` contexts now open: (layers, on_hidden)
        self._observers: list[tuple[tuple[int, ...], Any]] = []
        #: while a captured step's body runs: where its hooks and attention calls leave what they saw
        self._tap: _Tap | None = None
        #: the captured steps, the most recently used last, at most ``max_graphs`` (their slabs come
        #: from ``pool``, so the next sequences of a shape replay them)
        self._graphed: OrderedDict[tuple, GraphedStep] = OrderedDict()
        self.max_graphs = 16
        self.pool = SlabPool()
        self._graph_pool = None

    @property
    def pads_finished_rows(self) -> bool:
        """A batch keeps its finished rows as padding (``DecodeLoop._retire``) while steps are
        captured: a graph is captured per batch size, and dropping a row would mean a new one."""
        return self.graphs

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "decode_steps": dict(self.steps),
            "cuda_graphs": "on" if self.graphs and self.device.type == "cuda" else "off",
            "graph_captures": self.captures,
            "graph_capture_shapes": len(self.capture_shapes),
            "graph_capture_seconds": round(self.capture_seconds, 6),
            **self.pool.describe(),
        }

    def new_cache(self, reserve: int) -> SlabStore:
        return SlabStore(
            self.model.config, self.n_layers, self.n_kv_heads, self.device, reserve=reserve, pool=self.pool
        )

    def take_slab(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return self.pool.take(shape, like)

    def give_slab(self, slab: torch.Tensor, tenants=()) -> None:
        self.pool.give(slab, tenants)

    def graph_pool(self):
        """The one memory pool every captured step allocates in (each step's outputs are copied out
        before another step replays, so the graphs may share their scratch memory)."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def batch_layer(self, keys: torch.Tensor, values: torch.Tensor, rows) -> FixedBatchSlabLayer:
        return FixedBatchSlabLayer(keys, values, rows)

    @contextmanager
    def observing(self, kernel: str, hidden_layers: list[int], on_hidden) -> Iterator[None]:
        """As the HF backend's; inside a captured step's body the hooks leave their outputs on the tap,
        and :meth:`_deliver` hands copies to ``on_hidden`` after each replay."""

        def hook(layer: int, output: torch.Tensor) -> None:
            if self._tap is not None:
                self._tap.hidden[layer] = output
            else:
                on_hidden(layer, output)

        entry = (tuple(hidden_layers), on_hidden)
        with super().observing(kernel, hidden_layers, hook):
            self._observers.append(entry)
            try:
                yield
            finally:
                self._observers.remove(entry)

    def _deliver(self, tap: _Tap, cache) -> None:
        """What a captured step observed, as an eager step would have handed it over: each hidden
        state to the callbacks that hooked its layer, each attention call to the active recorder
        (its keys and values: ``cache``'s slabs, which the kernel saw). Copies: the tapped tensors
        are the graph's, and the next replay rewrites them."""
        hidden = dict(zip(tap.hidden, _copies(list(tap.hidden.values()))))
        for layers, on_hidden in self._observers:
            for layer in layers:
                on_hidden(layer, hidden[layer])
        recorder = active_recorder()
        if recorder is not None:
            layers = sorted(tap.attention)
            queries = _copies([tap.attention[layer][0] for layer in layers])
            weights = _copies([tap.attention[layer][1] for layer in layers])
            for layer, query, weight in zip(layers, queries, weights):
                keys, values = _slabs(cache.layers[layer])
                recorder.record(layer, query, keys, values, weight, tap.attention[layer][2])

    # -- one forward pass over the slabs ------------------------------------------------------------

    def forward(
        self,
        token_ids: torch.Tensor,
        rope_positions: torch.Tensor,
        cache,
        start_slot: int,
        attention_mask: torch.Tensor | None = None,
        decode: bool = False,
    ) -> torch.Tensor:
        """As :meth:`HFBackend.forward`, attending over the whole slab: ``attention_mask`` ``[N, S]``
        (valid slots of a ragged batch) is widened to the slab's capacity and made causal here. Only
        a decode loop's steps are captured: a fed one-token prompt or turn (a batch flushing each
        session's pending token) runs eagerly, not one capture per session and turn."""
        n, c = token_ids.shape
        layer = cache.layers[0]
        capacity = layer.slab_k.shape[-2] if isinstance(layer, BatchSlabLayer) else layer.planned(start_slot + c)
        recorder = active_recorder()
        if isinstance(recorder, AttentionRecorder):
            recorder.kv_length = start_slot + c  # a single sequence's valid slots (a batch's recorder cuts per row)
        batched = isinstance(layer, BatchSlabLayer)
        if c == 1 and decode and self.graphs and (batched or layer.capacity):
            if not batched:
                # grow before the step is keyed by the slabs' addresses (grown inside, it would be keyed
                # by the old ones and captured again at the next step)
                for each in cache.layers:
                    if each.capacity < capacity:
                        each.resize(capacity)
            self.steps["graph" if self.device.type == "cuda" else "static"] += 1
            return self._graph_step(token_ids, rope_positions, cache, start_slot, attention_mask, capacity)
        mask = self.slab_mask(n, c, capacity, start_slot, attention_mask)
        if c > 1:
            return self.model_step(token_ids, rope_positions, cache, start_slot, mask)
        self.steps["eager"] += 1
        if attention_mask is None:  # every row holds start_slot + 1 slots: SDPA reads those alone
            lengths = slab_attention.Lengths(None, start_slot + 1, grouped_eager=self.grouped_eager)
        else:
            lengths = slab_attention.Lengths(attention_mask.sum(dim=-1), grouped_eager=self.grouped_eager)
        with slab_attention.decoding(lengths):
            return self.model_step(token_ids, rope_positions, cache, start_slot, mask)

    def slab_mask(self, n: int, c: int, capacity: int, start_slot: int, valid: torch.Tensor | None) -> torch.Tensor:
        """``[N, 1, c, capacity]``: query j (at slot ``start_slot + j``) sees slot s iff s <= its slot
        and s is valid (``valid[:, s]``, True beyond nothing: slots past ``valid``'s width are free).
        Boolean for SDPA; additive (0 / the dtype's min, as HF builds it) for eager."""
        slots = torch.arange(capacity, device=self.device)
        visible = (
            slots[None, None, :] <= (start_slot + torch.arange(c, device=self.device))[None, :, None]
        )  # [1, c, cap]
        if valid is not None:
            wide = torch.zeros((n, capacity), dtype=torch.bool, device=self.device)
            wide[:, : valid.shape[-1]] = valid
            visible = visible & wide[:, None, :]
        visible = visible.expand(n, c, capacity)[:, None]
        if self.model.config._attn_implementation.endswith("eager"):
            return torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~visible, torch.finfo(self.dtype).min
            )
        return visible

    # -- CUDA graphs (taken on CUDA only) -----------------------------------------------------------

    def _graph_step(self, token_ids, rope_positions, cache, start_slot, attention_mask, capacity) -> torch.Tensor:
        n = token_ids.shape[0]
        layers = cache.layers
        if isinstance(layers[0], BatchSlabLayer):
            slots = (
                (attention_mask.sum(dim=-1) - 1)
                if attention_mask is not None
                else torch.full((n,), start_slot, device=self.device)
            )
        else:
            slots = torch.full((1,), start_slot, device=self.device)
        # the hooked layers shape the body (each leaves its output on the tap); attention calls are
        # tapped whether or not a recorder asks, so the recorder does not
        hooked = tuple(sorted({l for layers, _ in self._observers for l in layers}))
        # the graph reads and writes the slabs by address: a step replays it only over the buffers it
        # was captured over (a new session whose slabs the allocator placed at the same addresses too)
        key = (
            n,
            capacity,
            self.model.config._attn_implementation,
            self.grouped_eager,
            hooked,
            *(b.data_ptr() for layer in layers for b in _slabs(layer)),
        )
        step = self._graphed.get(key)
        if step is None:
            step = self._graphed[key] = GraphedStep(self, n, capacity)
            while len(self._graphed) > self.max_graphs:
                self._graphed.popitem(last=False)
        else:
            self._graphed.move_to_end(key)
        logits = step.run(
            cache,
            token_ids,
            rope_positions,
            slots,
            self.slab_mask(n, 1, capacity, start_slot, attention_mask),
            start_slot,
        )
        if not isinstance(layers[0], BatchSlabLayer):
            for layer in layers:  # the replay wrote the slot; the host-side length follows
                layer.set_length(start_slot + 1)
        return logits


def _copies(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """A copy of each tensor (None stays None): tensors of one shape (every layer's) in one op, views
    of one stack."""
    present = [t for t in tensors if t is not None]
    if len(tensors) > 1 and len(present) == len(tensors) and len({(t.shape, t.dtype) for t in present}) == 1:
        return list(torch.stack(present).unbind(0))
    return [None if t is None else t.clone() for t in tensors]


def _slabs(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's whole K and V slabs (a single sequence's, or a batch's)."""
    return layer.buffers if isinstance(layer, SlabLayer) else (layer.slab_k, layer.slab_v)


class _Tap:
    """What a captured step's body observed, per layer: the hooked hidden states, and each attention
    call's ``(query, weights, scaling)`` (its keys and values are the slabs, not held here: a graph
    keeps no session's memory alive). It stands in for the recorder while the body runs
    (``probe.recording``), so the body keeps no Python state."""

    def __init__(self) -> None:
        self.hidden: dict[int, torch.Tensor] = {}
        self.attention: dict[int, tuple] = {}

    def eager_rows(self, batch: int, heads: int, queries: int, keys: int) -> Rows:
        """Every row: a decode step's one query per sequence always fits the attention memory."""
        return "all"

    def record(self, layer: int, query, key, value, weights, scaling: float) -> None:
        self.attention[layer] = (query, weights, scaling)

    def rewrite(self, fresh: _Tap) -> None:
        """Copy ``fresh``'s tensors into this tap's, in place, as a replay rewrites a graph's memory."""
        for layer, out in fresh.hidden.items():
            self.hidden[layer].copy_(out)
        for layer, (query, weights, _) in fresh.attention.items():
            self.attention[layer][0].copy_(query)
            if weights is not None:
                self.attention[layer][1].copy_(weights)


class GraphedStep:
    """One decode step (batch ``n``, slab ``capacity``) captured as a CUDA graph over static buffers.

    On CUDA the body is captured once and replayed; elsewhere (tests) it runs eagerly over the same
    static buffers and taps. The capture itself has not run here: this repository's machines have
    no GPU (docs/gpu.md, GPU figures "not measured")."""

    def __init__(self, backend: SlabBackend, n: int, capacity: int):
        self.backend = backend
        self.shape = (n, capacity)
        device = backend.device
        self.tokens = torch.zeros((n, 1), dtype=torch.long, device=device)
        self.rope = torch.zeros((n, 1), dtype=torch.long, device=device)
        self.slots = torch.zeros((n,), dtype=torch.long, device=device)
        self.cache_position = torch.zeros((1,), dtype=torch.long, device=device)
        self.lengths = torch.zeros((n,), dtype=torch.long, device=device)  # each row's slots, its new one included
        self.mask = backend.slab_mask(n, 1, capacity, 0, None).clone()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.tap = _Tap()

    def _body(self, cache, tap: _Tap) -> torch.Tensor:
        """The step as captured: static inputs in, logits out, observations left on ``tap``; ``cache``
        only lends its layers' buffers (the step's key holds their addresses), so no cache is kept."""
        backend = self.backend
        for layer in cache.layers:
            layer.slots = self.slots
        backend._tap = tap
        try:
            lengths = slab_attention.Lengths(self.lengths, grouped_eager=backend.grouped_eager)
            with recording(tap), slab_attention.decoding(lengths):
                out = backend.model(
                    input_ids=self.tokens,
                    position_ids=self.rope,
                    attention_mask=self.mask,
                    cache_position=self.cache_position,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
        finally:
            backend._tap = None
            for layer in cache.layers:
                layer.slots = None
        return out.logits[:, -1]

    def run(self, cache, token_ids, rope, slots, mask, start_slot: int) -> torch.Tensor:
        self.tokens.copy_(token_ids)
        self.rope.copy_(rope)
        self.slots.copy_(slots)
        torch.add(slots, 1, out=self.lengths)
        self.mask.copy_(mask)
        self.cache_position.fill_(start_slot)
        if self.logits is None:  # this step's first run: the capture (off CUDA, the body's first run)
            clock = device_clock(self.backend.device)
            started = clock()
            logits = self._capture(cache)
            self.backend.captures += 1
            self.backend.capture_shapes.add(self.shape)
            self.backend.capture_seconds += clock() - started
        elif self.graph is not None:
            self.graph.replay()
            logits = self.logits.clone()
        else:
            logits = self._rerun(cache)
        self.backend._deliver(self.tap, cache)
        return logits

    def _capture(self, cache) -> torch.Tensor:
        if self.backend.device.type != "cuda":
            self.logits = self._body(cache, self.tap)
            return self.logits.clone()
        # warm up on a side stream (allocator pools, lazy kernels), then capture; the warm-up wrote
        # this step's K/V already, and the capture only records
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._body(cache, _Tap())
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.backend.graph_pool()):
            self.logits = self._body(cache, self.tap)
        self.graph.replay()
        return self.logits.clone()

    def _rerun(self, cache) -> torch.Tensor:
        """Off CUDA: the body eagerly, its logits and taps rewritten into the first run's tensors, as
        a replay rewrites the graph's, so a consumer that kept a reference sees them change too."""
        logits = self.logits
        assert logits is not None  # the first run (_capture) set it
        fresh = _Tap()
        logits.copy_(self._body(cache, fresh))
        self.tap.rewrite(fresh)
        return logits.clone()
