"""Observation of queries and attention rows under any attention kernel.

kvleague registers wrappers ``kvleague_sdpa``, ``kvleague_eager`` and ``kvleague_flash_attention_2``
in transformers' attention (and mask) interfaces. Each calls the real kernel unchanged, and when a
:class:`AttentionRecorder` is active it records what the running method asked for: post-RoPE
queries, the new keys/values, and softmax attention rows of the newest ``window`` queries, computed
here from q and the cached K (``w x T`` per head, never ``T x T``), so attention-based methods run
under SDPA and FlashAttention too.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvleague.engine import slab_attention
from kvleague.engine.attention import attention_rows
from kvleague.engine.batch_invariance import attend_by_length, visible_prefix
from kvleague.engine.contract import over_chunks
from kvleague.engine.eager import Rows, budget_bytes, eager_attention
from kvleague.engine.to_device import to_device

INNER_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("kvleague_recorder", default=None)


class Recorder(Protocol):
    """What the attention wrappers hand each call to: an :class:`AttentionRecorder`, or a captured
    step's tap (``slab.py``), which stands in for one while the step's body runs."""

    def eager_rows(self, batch: int, heads: int, queries: int, keys: int) -> Rows: ...
    def record(self, layer: int, query, key, value, weights, scaling: float) -> None: ...


def wrapper_name(inner: str) -> str:
    return f"kvleague_{inner}"


@dataclass
class AttentionRecorder:
    """Collects per-layer observations for one forward pass; fields stay ``None`` unless asked for."""

    n_layers: int
    queries: bool = False
    new_keys_values: bool = False
    attention: bool = False
    window: int = 1
    #: every query of the pass (a method that declared ``Needs.eager``), not the newest ``window``
    all_queries: bool = False
    #: with ``all_queries``: each key's weights summed over the queries will do (``Needs.attention_sum``)
    attention_sum: bool = False
    new_tokens: int = 0
    q: list = field(default_factory=list)
    k_new: list = field(default_factory=list)
    v_new: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    #: the cache's valid slots when the kernel saw a fixed slab's whole capacity (``slab.py``); None:
    #: every key the kernel saw is a cached slot
    kv_length: int | None = None

    def start(self, new_tokens: int) -> None:
        self.new_tokens = new_tokens
        self.q = [None] * self.n_layers
        self.k_new = [None] * self.n_layers
        self.v_new = [None] * self.n_layers
        self.rows = [None] * self.n_layers

    def eager_rows(self, batch: int, heads: int, queries: int, keys: int) -> Rows:
        """What the eager kernel returns: every row, or (where every layer's rows of this pass would not
        fit the attention memory and the method takes it) their sum over the queries."""
        if not (self.attention and self.all_queries and self.attention_sum):
            return "all"
        every_layer = 4 * self.n_layers * batch * heads * queries * keys
        return "sum" if every_layer > budget_bytes() else "all"

    def record(self, layer: int, query, key, value, weights, scaling: float) -> None:
        c = self.new_tokens
        if self.kv_length is not None:
            key, value = key[:, :, : self.kv_length], value[:, :, : self.kv_length]
            weights = weights[..., : self.kv_length] if weights is not None else None
        if self.queries:
            self.q[layer] = query[0]
        if self.new_keys_values:
            self.k_new[layer] = key[0, :, -c:]
            self.v_new[layer] = value[0, :, -c:]
        if self.attention:
            if weights is not None:  # eager kernel: its own exact weights, not a recomputation
                self.rows[layer] = (weights[0] if self.all_queries else weights[0, :, -self.window :]).float()
            else:
                self.rows[layer] = attention_rows(query[0, :, -self.window :], key[0], scaling)


@dataclass
class BatchAttentionRecorder(AttentionRecorder):
    """The recorder of a batched decode step (one new token per row; engine/decode.py).

    Row i's cache holds ``lengths[i]`` slots after the step appended its token at slot
    ``lengths[i] - 1``; the slots beyond are padding. :meth:`row` cuts row i's observations out of
    the batched tensors exactly as :class:`AttentionRecorder` cuts a single sequence's, so a
    method sees the same tensors at any batch size."""

    lengths: list = field(default_factory=list)
    raw: list = field(default_factory=list)
    _float_weights: dict = field(default_factory=dict)
    _stacked_queries: torch.Tensor | None = None
    _stacked_new: tuple | None = None
    #: the rows whose method asks for attention rows this step (computed together where no kernel gives weights)
    wanted: frozenset = frozenset()
    _rows_of: dict | None = None
    #: ``[L, N, H, S, d]``: every layer's keys in one tensor (a batch's slabs), whose layers the
    #: kernels saw; None: the layers' keys are apart
    keys: torch.Tensor | None = None

    def start_batch(self, lengths: list[int], wanted=frozenset(), keys: torch.Tensor | None = None) -> None:
        self.start(1)
        self.lengths = lengths
        self.wanted = wanted
        self.keys = keys
        self.raw = [None] * self.n_layers
        self._float_weights = {}
        self._stacked_queries = None
        self._stacked_new = None
        self._rows_of = None

    def _weights(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s eager weights in float32, converted once for every row of the batch."""
        if layer not in self._float_weights:
            self._float_weights[layer] = self.raw[layer][3].float()
        return self._float_weights[layer]

    def record(self, layer: int, query, key, value, weights, scaling: float) -> None:
        self.raw[layer] = (query, key, value, weights, scaling)

    def _all_weights(self) -> torch.Tensor:
        """``[N, L, H_q, 1, T]``: every layer's eager weights in float32, stacked once for every row."""
        if "all" not in self._float_weights:
            self._float_weights["all"] = torch.stack([w for _, _, _, w, _ in self.raw], dim=1).float()
        return self._float_weights["all"]

    def _new_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, L, H, 1, d]`` keys and values: every row's new entry (at its slot ``lengths[i] - 1``) of
        every layer, gathered once for every row."""
        if self._stacked_new is None:
            k0 = self.raw[0][1]
            rows = torch.arange(len(self.lengths), device=k0.device)
            slots = to_device([n - 1 for n in self.lengths], k0.device)
            self._stacked_new = tuple(
                torch.stack([x[rows, :, slots] for x in per_layer], dim=1).unsqueeze(-2)
                for per_layer in ([k for _, k, _, _, _ in self.raw], [v for _, _, v, _, _ in self.raw])
            )
        return self._stacked_new

    def _queries(self) -> torch.Tensor:
        """``[N, L, H_q, 1, d]``: every layer's queries in one tensor, stacked once for every row."""
        if self._stacked_queries is None:
            self._stacked_queries = torch.stack([q for q, _, _, _, _ in self.raw], dim=1)
        return self._stacked_queries

    def row(
        self, i: int, queries: bool, new_keys_values: bool, attention: bool
    ) -> dict[str, torch.Tensor | list[torch.Tensor] | None]:
        """Row i's ``queries`` (one ``[L, H_q, 1, d]`` tensor), ``new_keys`` / ``new_values`` (one
        ``[L, H, 1, d]`` each) and ``attention`` (one ``[L, H_q, 1, T]`` tensor; per layer where the
        kernels differ between layers); ``None`` unless asked."""
        n = self.lengths[i]
        out: dict[str, torch.Tensor | list[torch.Tensor] | None] = {
            "queries": None,
            "new_keys": None,
            "new_values": None,
            "attention": None,
        }
        if queries:
            out["queries"] = self._queries()[i]
        if new_keys_values:
            out["new_keys"], out["new_values"] = (x[i] for x in self._new_keys_values())
        if attention:
            if all(
                w is not None for _, _, _, w, _ in self.raw
            ):  # the eager kernel's weights, every layer's in one tensor
                out["attention"] = self._all_weights()[i, ..., :n]
            elif all(w is None for _, _, _, w, _ in self.raw) and i in self.wanted:
                out["attention"] = self._computed_rows()[i]
            else:
                out["attention"] = [
                    self._weights(layer)[i, :, :, :n]
                    if w is not None
                    else attention_rows(q[i, :, -1:], k[i, :, :n], scaling)
                    for layer, (q, k, _, w, scaling) in enumerate(self.raw)
                ]
        return out

    def _computed_rows(self) -> dict[int, torch.Tensor]:
        """Row -> ``[L, H_q, 1, n]``: the newest query's attention rows of every layer, computed from q
        and K (a kernel without weights) for the rows in ``wanted``: rows holding equal numbers of
        slots together, every layer in one matmul where the layers' keys are one tensor (as many
        layers at once as keep the float32 work under ``STACK_BYTES``), else one per layer."""
        if self._rows_of is None:
            self._rows_of = {}
            by_length: dict[int, list[int]] = {}
            for i in sorted(self.wanted):
                by_length.setdefault(self.lengths[i], []).append(i)
            keys = self._stacked_keys()
            for n, rows in by_length.items():
                index = None if rows == list(range(len(self.lengths))) else to_device(rows, self.raw[0][0].device)
                scaling = self.raw[0][4]
                if keys is not None:
                    q, k = self._queries()[:, :, :, -1:], keys[:, :, :, :n]  # [N, L, H_q, 1, d], [L, N, H, n, d]
                    if index is not None:
                        q, k = q.index_select(0, index), k.index_select(1, index)
                    m, n_layers, h_q, _, d = q.shape
                    # contiguous: a matmul over a strided view of several layers takes another GEMM
                    # path, whose float32 bits differ from one layer's alone
                    stacked = over_chunks(
                        lambda part: attention_rows(q[:, part], k[part].transpose(0, 1).contiguous(), scaling),  # noqa: B023 - called before the loop moves on
                        n_layers,
                        4 * m * n * (k.shape[2] * d + 2 * h_q),
                        dim=1,
                    )  # [m, L, H_q, 1, n]
                else:
                    per_layer = []
                    for q, k, _, _, scaling in self.raw:
                        q, k = q[:, :, -1:], k[:, :, :n]
                        if index is not None:
                            q, k = q.index_select(0, index), k.index_select(0, index)
                        per_layer.append(attention_rows(q, k, scaling))  # [m, H_q, 1, n]
                    stacked = torch.stack(per_layer, dim=1)  # [m, L, H_q, 1, n]
                self._rows_of.update(zip(rows, stacked.unbind(0)))
        return self._rows_of

    def _stacked_keys(self) -> torch.Tensor | None:
        """``keys`` where every layer's recorded keys are its layer of it (the same memory; else None)
        and every layer has one scaling."""
        keys = self.keys
        if keys is None or len({scaling for *_, scaling in self.raw}) != 1:
            return None
        step = keys.stride(0) * keys.element_size()
        if any(
            k.data_ptr() != keys.data_ptr() + l * step
            or k.shape[:2] != keys.shape[1:3]
            or k.stride() != keys.stride()[1:]
            for l, (_, k, _, _, _) in enumerate(self.raw)
        ):
            return None
        return keys


def active_recorder() -> Recorder | None:
    """The recorder of the forward passes running now (None when nothing records)."""
    return _ACTIVE.get()


class recording:
    """Context manager activating a recorder for the forward passes run inside it."""

    def __init__(self, recorder: Recorder | None):
        self.recorder = recorder

    def __enter__(self):
        self.token = _ACTIVE.set(self.recorder)
        return self.recorder

    def __exit__(self, *exc):
        _ACTIVE.reset(self.token)


def _make_wrapper(inner: str):
    # The signature of transformers' sdpa kernel; callers (and kvpress's import-time patch, which
    # passes dropout positionally) rely on it, so the kernel is called by keyword.
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if scaling is None:
            scaling = module.scaling
        recorder = _ACTIVE.get()
        if inner == "eager":  # over query chunks within the worker's attention memory
            batch, heads, queries = query.shape[:3]
            rows = "all" if recorder is None else recorder.eager_rows(batch, heads, queries, key.shape[-2])
            lengths = slab_attention.active() if queries == 1 else None
            if lengths is not None and lengths.grouped_eager:  # a slab decode step, each KV head read once
                out, weights = slab_attention.attend_eager(query, key, value, attention_mask, scaling, lengths)
                weights = weights.float() if rows == "sum" else weights  # one query: its sum is its row
            else:
                out, weights = eager_attention(
                    module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, rows=rows, **kwargs
                )
        else:
            lengths = slab_attention.active() if inner == "sdpa" and query.shape[2] == 1 else None
            kernel = ALL_ATTENTION_FUNCTIONS[inner]
            if lengths is not None:  # a slab decode step: attention by lengths, in the KV heads as they are
                out, weights = slab_attention.attend(query, key, value, scaling, lengths), None
            elif (
                inner == "sdpa"
                and query.shape[2] == 1
                and attention_mask is not None
                and query.device.type == "cpu"
                and (prefix := visible_prefix(attention_mask)) is not None
            ):
                # a ragged decode step: each row over its own slots, as alone (engine/batch_invariance.py)
                out = attend_by_length(
                    lambda q, k, v: kernel(module, q, k, v, None, dropout=dropout, scaling=scaling, **kwargs),
                    query,
                    key,
                    value,
                    prefix,
                )
                weights = None
            else:
                out, weights = kernel(
                    module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
                )
        if recorder is not None:
            recorder.record(module.layer_idx, query, key, value, weights, scaling)
        return out, weights

    attention.__name__ = f"kvleague_{inner}_attention"
    return attention


def register_wrappers() -> None:
    """Idempotently register the probing wrappers with transformers."""
    for inner in INNER_IMPLEMENTATIONS:
        name = wrapper_name(inner)
        if name in ALL_ATTENTION_FUNCTIONS:
            continue
        AttentionInterface.register(name, _make_wrapper(inner))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])


register_wrappers()
