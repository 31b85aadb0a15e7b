"""The contract between the generation engine and an eviction method.

A method is a dataclass subclass of :class:`EvictionMethod`:

* its **dataclass fields are its hyperparameters** (typed, with defaults); per-sequence state lives in
  plain attributes set by :meth:`EvictionMethod.reset`, never in fields;
* the class attribute ``needs`` (a :class:`Needs`) declares which observations the engine must
  collect for it; the engine collects exactly those and nothing more;
* :meth:`EvictionMethod.observe` is called after every forward pass (each prefill chunk and each
  decode step) with an :class:`Observation`;
* :meth:`EvictionMethod.score` is called only when the engine is about to evict, with a
  :class:`CacheView` of the current cache, and returns scores where **higher means keep**.

Score shapes (``T`` = current cache length, ``L`` = layers, ``H`` = KV heads):

* ``[T]``        one score per cached token: the same positions are kept in every layer and head;
* ``[L, T]``     per layer: each layer keeps its own set;
* ``[L, H, T]``  per KV head: each KV head of each layer keeps its own set.

The engine, not the method, applies the protocol: protected tokens (sinks, the recent window, the
prompt) are always kept, the rest of the budget goes to the highest-scoring evictable slots, and the
cache tensors are physically gathered. Methods therefore never see or enforce the budget rules
themselves; this keeps every method under identical rules within a run.

**Keeping fewer than B.** A method that declares ``Needs(keeps_fewer=True)`` may score a slot
``-inf``, meaning "must drop": when the engine evicts (the cache is above B), it drops every
unprotected slot scored ``-inf`` even if the cache then holds fewer than B, and fills the rest of B
from the other slots as usual. (Any other method keeps exactly B, a count known without reading
the device; a ``-inf`` score from it is an error.) Protected slots stay whatever their score.
The cache refills to B before the next eviction. Every layer and KV head must then keep the same
number of slots (a ``[T]`` score always does; ``[L, T]`` / ``[L, H, T]`` scores whose ``-inf`` counts
leave different numbers are an error). A method that never returns ``-inf`` always keeps exactly B
(or the protected tokens, when they alone exceed B under ``prompt_over_budget: keep``). Methods
whose reference keeps only per-segment quotas (``thinkv_authors``, ``epikv_seg``) use this.

Within each layer and KV head, slots are always in increasing absolute position (eviction keeps
the order), so pooling over neighbouring slots or cutting the cache into position chunks is sound.
A method that never relies on slot order (its scores are a function of each slot's own content and
position, however the slots are arranged) may say so with ``Needs(ordered_slots=False)``: the
engine then evicts by moving kept slots into the holes, O(evicted) instead of O(cache) per step,
and its slots are in no particular order (results still report kept positions sorted). A method
whose scores are order-free but whose references keep the order (``Needs(order_free_scores=True)``:
the EpiKV family, KV-key / KV-val, H2O, SnapKV) keeps it on the ``hf`` backend and is evicted as order-free where
the backend reorders for speed (the slab backend on CUDA).
Slot indices are not stable across evictions: a method that keeps per-token state keys it by
**absolute position** (``CacheView.positions`` / ``Observation.cache_positions``). Tensors in a
``CacheView`` are valid during the ``score`` call only.

**Batches** (``Engine.generate_batch``; the decode loop, ``engine/decode.py``). Every sequence of a batch has
its own method instance, reset with its own :class:`SequenceInfo`; the engine calls the classmethods
:meth:`EvictionMethod.observe_batch` and :meth:`EvictionMethod.score_batch` once per method class
with the instances of the sequences concerned. Their defaults call ``observe`` / ``score`` of each
instance, so a method written for one sequence runs batched unchanged. A method may override them
to vectorise over the batch; it must then return, for each sequence, what ``score`` would return
for that sequence alone (``tests/test_batch.py`` checks every built-in method this way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

if TYPE_CHECKING:  # tensors are only annotations here: the registries and the CLI import this without torch
    import torch

Phase = Literal["prefill", "decode"]


@dataclass(frozen=True)
class Needs:
    """What a method needs the engine to observe. Everything defaults to "not needed"."""

    #: hidden states of the layers returned by ``EvictionMethod.hidden_layers``, for the new tokens
    hidden_states: bool = False
    #: the new tokens' keys and values (post-RoPE keys, as stored in the cache), per layer
    new_keys_values: bool = False
    #: the new tokens' query states (post-RoPE), per layer
    queries: bool = False
    #: softmax attention rows of the last ``attention_window`` new queries over the whole cache,
    #: computed from q and K (never the full n x n matrix), so they work under SDPA and FlashAttention
    attention: bool = False
    #: how many of the newest queries of a forward pass get attention rows (decode steps have one)
    attention_window: int = 1
    #: exact eager attention (the model runs with ``attn_implementation="eager"``); with ``attention``
    #: the rows then come from the eager kernel's own weights, for every query of the pass (H2O's
    #: prefill column sums need them all). A method that does not declare it gets the newest
    #: ``attention_window`` rows under every kernel, eager included
    eager: bool = False
    #: with ``eager``: the method reads only each key's attention summed over the pass's queries (H2O's
    #: accumulated attention), so where every layer's rows of a long prefill would not fit the worker's
    #: attention memory (``engine/eager.py``) a pass's rows come as that sum, ``[H_q, 1, T]`` per layer
    attention_sum: bool = False
    #: the method relies on slots being in increasing position order (the default contract); set
    #: False for an order-free method to get the faster eviction path (see the module docstring)
    ordered_slots: bool = True
    #: with ``ordered_slots``: the method's scores are each slot's own, however the slots are arranged,
    #: and only its references (the authors' code, kvpress) keep them in position order, where the
    #: model's attention sums them in that order. A backend that fills holes for speed
    #: (``reorders_slots``: the slab backend on CUDA, whose kernels part from ``hf``'s bits anyway)
    #: then evicts it as an order-free method; ``hf`` keeps the order, bit for bit with the references
    order_free_scores: bool = False
    #: the method may score slots -inf (must drop), so that the cache keeps fewer than B ("Keeping
    #: fewer than B" above): the engine then reads each eviction's counts from the device before
    #: moving anything. Any other method keeps exactly B, a count the host knows, so an eviction
    #: makes the host wait for nothing (``engine/deferred_reads.py``; a -inf score from it is an error)
    keeps_fewer: bool = False


@dataclass
class SequenceInfo:
    """Facts about the model and the run, handed to :meth:`EvictionMethod.reset` once per sequence."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    budget: int
    seed: int
    device: torch.device
    #: the model's dtype (attention rows arrive in float32; a method that reproduces code written
    #: against HF's outputs casts them back to average in the same precision); None: float32
    dtype: torch.dtype | None = None
    #: the backend's Hugging Face model, for a bridge that scores with the model's own modules
    #: (``methods/kvpress_bridge.py``: a kvpress press takes an attention module); None where the
    #: backend has none. The engine's own methods never read it
    model: Any = None
    #: the compression ratio a ratio budget was given as (``budget: ratio R``; ``Protocol.ratio``),
    #: for a method defined by the ratio rather than the kept count; None under an absolute budget
    ratio: float | None = None
    #: whether the engine keeps this sequence's slots in increasing position order: False for a method
    #: declaring ``Needs(ordered_slots=False)``, or ``order_free_scores`` where the backend reorders
    ordered_slots: bool = True

    def __post_init__(self) -> None:
        if self.dtype is None:
            import torch

            self.dtype = torch.float32


@dataclass
class Observation:
    """What one forward pass produced. Fields a method did not declare in ``Needs`` are ``None``.

    Tensors have the batch dimension removed. ``cache_positions`` is always present.
    """

    phase: Phase
    #: absolute positions of the new tokens, shape ``[C]``
    new_positions: torch.Tensor
    #: token ids of the new tokens, shape ``[C]``
    new_token_ids: torch.Tensor
    #: absolute position of every cache slot after this pass appended its tokens (before any
    #: eviction), one ``[H, T]`` tensor per layer (a :class:`PerLayer`, also one ``[L, H, T]`` tensor:
    #: ``.stacked``; a list given is made one)
    cache_positions: PerLayer
    #: layer index -> ``[C, hidden]`` (a dict, or a batched step's :class:`RowHidden`): output of
    #: decoder layer ``l`` (HF ``hidden_states[l + 1]`` for every layer but the last, where HF
    #: applies the final norm)
    hidden_states: Mapping[int, torch.Tensor] | None = None
    #: per layer ``[H, C, d]``, indexed by layer: a list, or one ``[L, H, C, d]`` tensor (a batched decode step's)
    new_keys: list[torch.Tensor] | torch.Tensor | None = None
    new_values: list[torch.Tensor] | torch.Tensor | None = None
    #: per layer ``[H_q, C, d]`` (post-RoPE), indexed by layer: a list, or one ``[L, H_q, C, d]`` tensor
    #: (a batched decode step's, which stacks every layer once for all rows)
    queries: list[torch.Tensor] | torch.Tensor | None = None
    #: per layer ``[H_q, w, T]`` float32 softmax rows of the last ``w`` new queries over all T slots,
    #: indexed by layer: a list, or one ``[L, H_q, w, T]`` tensor (a batched decode step's)
    attention: list[torch.Tensor] | torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.cache_positions = PerLayer.of(self.cache_positions)


class RowHidden(Mapping):
    """Row ``row`` of a batched decode step's hidden states (``batch``: layer -> ``[N, C, hidden]``) as
    ``Observation.hidden_states`` (layer -> ``[C, hidden]``, for ``layers``): each layer's row is cut
    when read, and :func:`batch_hidden` reads a layer of every row of the batch as one tensor."""

    def __init__(self, batch: dict[int, torch.Tensor], row: int, layers: Sequence[int]):
        self.batch, self.row, self.layers = batch, row, layers

    def __getitem__(self, layer: int) -> torch.Tensor:
        if layer not in self.layers:
            raise KeyError(layer)
        return self.batch[layer][self.row]

    def __iter__(self):
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)


class PerLayer(tuple):
    """The cache's per-layer ``[H, T]`` bookkeeping (positions, prompt flags): a tuple of one tensor per
    layer (what ``torch.stack`` and ``zip`` take), cut from one table, which ``stacked`` gives whole
    as ``[L, H, T]`` with no op (a broadcast view where every layer shares one ``[H, T]``, ``n_layers``
    given), so a batched method reads it without stacking the layers again."""

    _table: torch.Tensor
    _n_layers: int | None

    def __new__(
        cls, table: torch.Tensor, n_layers: int | None = None, layers: Sequence[torch.Tensor] | None = None
    ) -> PerLayer:
        """``layers``: ``table``'s layers cut already (a batch's, cut for every row at once)."""
        if layers is None:
            layers = table.unbind(0) if n_layers is None else (table,) * n_layers
        self = super().__new__(cls, layers)
        self._table, self._n_layers = table, n_layers
        return self

    def __reduce__(self):
        return PerLayer, (self._table, self._n_layers)

    @classmethod
    def of(cls, per_layer: Sequence[torch.Tensor]) -> PerLayer:
        """``per_layer`` itself when it is one, else its tensors stacked (a list a test or a caller made)."""
        import torch

        return per_layer if isinstance(per_layer, PerLayer) else cls(torch.stack(list(per_layer)))

    @property
    def stacked(self) -> torch.Tensor:
        """``[L, H, T]``."""
        if self._n_layers is None:
            return self._table
        return self._table.expand(self._n_layers, *self._table.shape)

    @property
    def shape(self) -> tuple[int, ...]:
        """``stacked``'s shape, read without an op."""
        return (len(self), *self._table.shape[-2:])


def batch_hidden(observations: Sequence[Observation], layer: int) -> torch.Tensor:
    """``[n, C, hidden]``: layer ``layer``'s hidden states of every observation, one tensor (the batch's
    own, or its rows, where the observations are rows of one batched step; else stacked)."""
    import torch

    hidden: list[Mapping[int, torch.Tensor]] = []
    for o in observations:
        assert o.hidden_states is not None  # only a method that declared Needs.hidden_states reads them
        hidden.append(o.hidden_states)
    first = hidden[0]
    if isinstance(first, RowHidden):
        of_batch = [h for h in hidden if isinstance(h, RowHidden) and h.batch is first.batch]
        if len(of_batch) == len(hidden):
            batch, rows = first.batch[layer], [h.row for h in of_batch]
            if rows == list(range(batch.shape[0])):
                return batch
            from kvleague.engine.to_device import to_device

            return batch.index_select(0, to_device(rows, batch.device))
    return torch.stack([h[layer] for h in hidden])


def stacked_layers(per_layer) -> torch.Tensor:
    """Per-layer tensors (a list, a :class:`PerLayer`, or one tensor already: a batched step's) as one
    ``[L, ...]`` tensor."""
    import torch

    if isinstance(per_layer, PerLayer):
        return per_layer.stacked
    return per_layer if isinstance(per_layer, torch.Tensor) else torch.stack(list(per_layer))


def newest_rows(attention) -> torch.Tensor:
    """``[L, H_q, T]``: the newest query's attention row of every layer of ``Observation.attention``."""
    import torch

    if isinstance(attention, torch.Tensor):  # a batched step's, [L, H_q, w, T]: one copy, the layout of the stack below
        return attention[:, :, -1, :].contiguous()
    return torch.stack([r[:, -1, :] for r in attention])


class CacheView:
    """Read-only view of the cache at eviction time, handed to :meth:`EvictionMethod.score`.

    The engine passes ``layers`` (``layers(0)``: the keys, ``layers(1)``: the values) instead of the
    lists, and callables for ``positions`` / ``is_prompt``: each is built on first read, so a method
    that scores from positions or its own state (EpiKV) costs no per-layer slicing of the cache, one
    that scores from keys (Knorm) none of its values or bookkeeping."""

    def __init__(
        self,
        keys: list[torch.Tensor] | None = None,
        values: list[torch.Tensor] | None = None,
        *,
        positions: Sequence[torch.Tensor] | Callable[[], PerLayer],
        is_prompt: Sequence[torch.Tensor] | Callable[[], PerLayer],
        budget: int,
        phase: Phase,
        current_position: int,
        layers: Callable[[int], list[torch.Tensor]] | None = None,
        length: int | None = None,
    ):
        self._kv, self._layers = [keys, values], layers
        self._bookkeeping = [positions, is_prompt]
        self._length = length
        #: number of slots the engine will keep
        self.budget = budget
        self.phase = phase
        #: absolute position of the newest token
        self.current_position = current_position

    def _tensors(self, which: int) -> list[torch.Tensor]:
        tensors = self._kv[which]
        if tensors is None:
            if self._layers is None:
                raise ValueError("CacheView: give keys and values, or layers")
            tensors = self._kv[which] = self._layers(which)
        return tensors

    def _read(self, which: int) -> PerLayer:
        given = self._bookkeeping[which]
        if not isinstance(given, PerLayer):
            self._bookkeeping[which] = given = given() if callable(given) else PerLayer.of(given)
        return given

    @property
    def positions(self) -> PerLayer:
        """Per layer ``[H, T]`` absolute positions of the slots (also ``[L, H, T]``: ``.stacked``)."""
        return self._read(0)

    @property
    def is_prompt(self) -> PerLayer:
        """Per layer ``[H, T]``: True where the slot holds a prompt (fed, not generated) token."""
        return self._read(1)

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer ``[H, T, d]`` (post-RoPE, as cached)."""
        return self._tensors(0)

    @property
    def values(self) -> list[torch.Tensor]:
        """Per layer ``[H, T, d]``."""
        return self._tensors(1)

    @property
    def length(self) -> int:
        """Slots held (T)."""
        return self.positions.shape[-1] if self._length is None else self._length

    @property
    def token_positions(self) -> torch.Tensor:
        """``[T]`` absolute positions, valid while all layers and heads hold the same tokens."""
        return self.positions[0][0]

    def __repr__(self) -> str:
        return f"CacheView(length={self.length}, budget={self.budget}, phase={self.phase!r}, current_position={self.current_position})"


#: the most bytes a batched computation over stacked layers or rows may hold at once (:func:`chunks`)
STACK_BYTES = 256 << 20


def chunks(count: int, bytes_each: int) -> list[slice]:
    """``range(count)`` in slices of as many items as keep ``bytes_each`` apiece under
    :data:`STACK_BYTES` (at least one each): the layers (or rows) a batched computation takes at once."""
    step = max(1, STACK_BYTES // max(bytes_each, 1))
    return [slice(start, min(start + step, count)) for start in range(0, count, step)]


def over_chunks(compute: Callable[[slice], torch.Tensor], count: int, bytes_each: int, dim: int = 0) -> torch.Tensor:
    """``compute(part)`` for each slice of :func:`chunks`, concatenated along ``dim`` (the one result
    as it is where one chunk holds everything)."""
    import torch

    parts = [compute(part) for part in chunks(count, bytes_each)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def groups_by(keys: Sequence) -> list[list[int]]:
    """Indices ``0..N-1`` grouped by equal ``keys[i]`` (first-seen order): the sequences of a batch a
    method can process as one tensor (e.g. those holding the same number of slots)."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


class BatchCacheView:
    """The caches of the sequences of a batch that evict now (one method class), for ``score_batch``.

    ``views[i]`` is sequence i's own :class:`CacheView` (what ``score`` gets). ``keys`` / ``values``
    are the same entries as one padded tensor per layer, ``[N, H, S, d]`` with ``S`` = the longest
    cache: row i holds ``lengths[i]`` slots, the rest is padding a method must ignore. Every layer's
    are also one tensor, ``stacked(0)`` (keys) / ``stacked(1)`` (values), ``[L, N, H, S, d]``, for a
    method that treats the layers at once. Each is built on first use by ``padded(which)`` (a view
    of the batched slab when the rows are contiguous, else a copy)."""

    def __init__(self, views: list[CacheView], padded: Callable[[int], torch.Tensor]):
        self.views = views
        self.lengths = [v.length for v in views]
        self._padded = padded
        self._stacked: list[torch.Tensor | None] = [None, None]
        self._members_rows: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
        self._per_layer: dict[tuple, list[torch.Tensor]] = {}  # the lists of layers, cut once each

    def __len__(self) -> int:
        return len(self.views)

    @property
    def equal_lengths(self) -> bool:
        """Every sequence holds the same number of slots (then ``keys`` has no padding)."""
        return len(set(self.lengths)) == 1

    def stacked(self, which: int) -> torch.Tensor:
        """``[L, N, H, S, d]``: every layer's keys (``which`` 0) or values (1), padded as ``keys``."""
        stacked = self._stacked[which]
        if stacked is None:
            stacked = self._stacked[which] = self._padded(which)
        return stacked

    def _layers(self, which: int, members: list[int] | None) -> list[torch.Tensor]:
        key = (which, None if members is None else tuple(members))
        if key not in self._per_layer:
            whole = self.stacked(which) if members is None else self.stacked_of(members, which)
            self._per_layer[key] = list(whole.unbind(0))
        return self._per_layer[key]

    @property
    def keys(self) -> list[torch.Tensor]:
        return self._layers(0, None)

    @property
    def values(self) -> list[torch.Tensor]:
        return self._layers(1, None)

    def keys_of(self, members: list[int]) -> list[torch.Tensor]:
        """Per layer ``[n, H, T, d]``: the keys of the sequences ``members``, which hold the same number
        of slots T, without padding (views of ``keys`` when ``members`` are consecutive)."""
        return self._layers(0, members)

    def values_of(self, members: list[int]) -> list[torch.Tensor]:
        """As :meth:`keys_of`, the values."""
        return self._layers(1, members)

    def stacked_of(self, members: list[int], which: int) -> torch.Tensor:
        """``[L, n, H, T, d]``: :meth:`keys_of` (``which`` 0) or :meth:`values_of` (1), every layer in one tensor."""

        key = (tuple(members), which)
        if key not in self._members_rows:
            t = self.lengths[members[0]]
            padded = self.stacked(which)
            first, last = members[0], members[-1]
            if members == list(range(first, last + 1)):  # a view
                rows = padded[:, first : last + 1, :, :t]
            else:
                from kvleague.engine.to_device import to_device

                rows = padded.index_select(1, to_device(members, padded.device))[:, :, :, :t]
            self._members_rows[key] = rows
        return self._members_rows[key]


@dataclass
class EvictionMethod:
    """Base class of every eviction method. See the module docstring for the contract."""

    #: registry name, set by ``@register_method``
    name: ClassVar[str] = ""
    needs: ClassVar[Needs] = Needs()

    def hidden_layers(self, n_layers: int) -> Sequence[int]:
        """Decoder layers whose hidden states ``observe`` receives (only with ``needs.hidden_states``)."""
        return range(n_layers)

    def reset(self, info: SequenceInfo) -> None:
        """Start a new sequence: drop all per-sequence state."""
        self.info = info

    def observe(self, obs: Observation) -> None:
        """Called after every forward pass; the default ignores it."""

    def score(self, cache: CacheView) -> torch.Tensor:
        """Scores for every cache slot, higher = keep; shape ``[T]``, ``[L, T]`` or ``[L, H, T]``."""
        raise NotImplementedError

    # -- batches: one instance per sequence; override to vectorise (see the module docstring) --

    @classmethod
    def observe_batch(cls, methods: Sequence[Self], observations: Sequence[Observation]) -> None:
        """``methods[i].observe(observations[i])`` for every sequence of a batch."""
        for method, obs in zip(methods, observations):
            method.observe(obs)

    @classmethod
    def score_batch(cls, methods: Sequence[Self], caches: BatchCacheView) -> list[torch.Tensor]:
        """``methods[i].score(caches.views[i])`` for every sequence of a batch that evicts now."""
        return [method.score(view) for method, view in zip(methods, caches.views)]

    # -- introspection used by the CLI, the registry and the database -------------------------

    @classmethod
    def hyperparameters(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.init]

    def params(self) -> dict:
        """Canonical hyperparameter dict (field order), JSON-serialisable."""
        return {f.name: getattr(self, f.name) for f in self.hyperparameters()}

    @property
    def never_evicts(self) -> bool:
        """True for methods that keep everything (the engine then skips scoring entirely)."""
        return False


__all__ = [
    "BatchCacheView",
    "CacheView",
    "PerLayer",
    "chunks",
    "groups_by",
    "over_chunks",
    "EvictionMethod",
    "Needs",
    "Observation",
    "Phase",
    "SequenceInfo",
]
