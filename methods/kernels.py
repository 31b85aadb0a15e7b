"""Kernels shared by several methods: per-position state, the observation window of queries and its
attention, segment and rank helpers. A method's own formula stays in its file; what
two or more methods compute the same way is defined here once."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from kvleague.engine.attention import attention_rows
from kvleague.engine.contract import (
    BatchCacheView,
    CacheView,
    EvictionMethod,
    Needs,
    Observation,
    SequenceInfo,
    chunks,
    groups_by,
    newest_rows,
    stacked_layers,
)

#: keep a :class:`PositionTable`'s mirror on the CPU too (as on a GPU): how tests and ``bench
#: step_ops`` run and count the GPU's path of :meth:`PositionTable.read`
MIRROR_ON_CPU = False


class PositionTable:
    """A float64 value per absolute position, growing by doubling (O(1) amortised appends).

    Written on the host; :meth:`read` reads it where the positions are: on a GPU from a mirror there,
    which a read first brings up to date (the values written one by one since, each a scalar fill;
    after a bulk :meth:`write`, the whole table once), so reading makes the host wait for nothing."""

    def __init__(self, fill: float = 0.0):
        self.fill = fill
        self._array = np.full(1024, fill)  # the memory of ``data``, read and written by numpy (``write_one``)
        self.data = torch.from_numpy(self._array)
        self._mirror: torch.Tensor | None = None
        #: written since the mirror was last brought up to date: (position, value), or None for "all"
        self._unsent: list[tuple[int, float]] | None = []

    def _grow(self, positions: torch.Tensor) -> None:
        self.reserve(int(positions.max()))

    def reserve(self, position: int) -> None:
        """Make room for every position up to ``position``."""
        if position >= self.data.shape[0]:
            grown = np.full(max(position + 1, 2 * self.data.shape[0]), self.fill)
            grown[: self.data.shape[0]] = self.data.numpy()
            self._array, self.data = grown, torch.from_numpy(grown)

    def write(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        self._grow(positions)
        self.data[positions.cpu()] = values.to(torch.float64).cpu()
        self._unsent = None

    def write_one(self, position: int, value: float) -> None:
        """``write`` of one value (the batched decode path)."""
        self.array(position)[position] = value
        if self._mirror is not None and self._unsent is not None:
            self._unsent.append((position, value))

    def array(self, top: int) -> np.ndarray:
        """The table as a numpy array, room made for every position up to ``top``: reads and writes
        through it are the table's, without a torch op (valid until the table grows again; what is
        written through it is not mirrored: :meth:`read` is for tables written by ``write`` /
        ``write_one``)."""
        self.reserve(top)
        # made again where ``data`` is not where it points (a copied table's would point at the original's)
        array = self._array
        if array.ctypes.data != self.data.data_ptr():
            self._array = array = self.data.numpy()
        return array

    def read(self, positions: torch.Tensor, top: int | None = None) -> torch.Tensor:
        """The values at ``positions`` on their device; ``fill`` at positions never written. ``top``: the
        largest of ``positions`` or more where the caller knows it (else read here, from the device)."""
        if positions.numel():
            self.reserve(int(positions.max()) if top is None else top)
        if positions.device.type == "cpu" and not MIRROR_ON_CPU:
            return self.data[positions]
        return self._mirrored(positions.device)[positions]

    def _mirrored(self, device: torch.device) -> torch.Tensor:
        """The table on ``device``, up to date."""
        mirror, size = self._mirror, self.data.shape[0]
        if mirror is None or mirror.device != device or self._unsent is None:
            mirror = self.data.to(device, copy=True)  # the first read, or after a bulk write
        else:
            if mirror.shape[0] < size:
                grown = torch.full((size,), self.fill, dtype=torch.float64, device=device)
                grown[: mirror.shape[0]] = mirror
                mirror = grown
            for position, value in self._unsent:
                mirror[position] = value  # a scalar: no copy from the host
        self._mirror, self._unsent = mirror, []
        return mirror

    def read_host(self, positions: torch.Tensor, top: int | None = None) -> torch.Tensor:
        """The values at ``positions`` on the host (no copy); ``top`` as :meth:`read`, else read here."""
        if positions.numel():
            self.reserve(int(positions.max()) if top is None else top)
        return self.data[positions]


def positions_on_host(views, with_prompt: bool = False) -> tuple[torch.Tensor, int | None]:
    """``[N, T]`` the token positions of cache views of equal lengths on the host, in one copy, and the
    largest (``None`` when empty). ``with_prompt``: ``[N, 2, T]``, each view's prompt flags (1 where
    the slot holds a prompt token) beside its positions, in the same copy."""
    # each view's first layer (no op for a cache whose layers agree), then the first head of them all
    positions = torch.stack([view.positions[0] for view in views])[:, 0]
    if with_prompt:
        positions = torch.stack([positions, torch.stack([view.is_prompt[0] for view in views])[:, 0].long()], dim=1)
    host = positions.cpu()
    top = host[:, 0] if with_prompt else host
    return host, (int(top.max()) if top.numel() else None)


def newest_on_host(
    observations: Sequence[Observation], keys: Sequence, reduce: Callable[[torch.Tensor, int], list[torch.Tensor]]
) -> Iterator[tuple[list[int], np.ndarray, np.ndarray, list[np.ndarray]]]:
    """The newest query's attention rows of a batch's observations, reduced on the device and brought
    to the host in one copy per group: observations with equal numbers of slots and new tokens and
    equal ``keys[i]`` (a method's hyperparameters) form a group. ``reduce(rows, i)`` maps the group's
    rows ``[n, L, H_q, T]`` to columns ``[n, k]`` (any k); ``i`` is a member, whose key the group shares. Yields per group the members' indices, their
    new tokens' positions ``[n, C]`` and cached positions ``[n, T]`` (int64) and the columns (float64).

    One observation alone goes the same way, so a sequence gets the same arithmetic alone and batched."""
    shapes = [(o.cache_positions.shape[-1], o.new_positions.shape[0], key) for o, key in zip(observations, keys)]
    for members in groups_by(shapes):
        group = [observations[i] for i in members]
        rows = torch.stack([newest_rows(o.attention) for o in group])  # [n, L, H_q, T]
        columns = reduce(rows, members[0])
        cached = torch.stack([o.cache_positions[0][0] for o in group])
        new = torch.stack([o.new_positions for o in group]).to(cached.device)
        widths = [new.shape[1], cached.shape[1]] + [c.shape[1] for c in columns]
        # float64 holds every position exactly
        host = torch.cat([new.double(), cached.double(), *(c.double() for c in columns)], dim=1).cpu().numpy()
        parts = np.split(host, np.cumsum(widths)[:-1], axis=1)
        yield members, parts[0].astype(np.int64), parts[1].astype(np.int64), parts[2:]


class QueryWindow:
    """The last ``window`` post-RoPE queries of every layer, with their absolute positions.

    Queries are kept across prefill chunks and decode steps, so "the last ``window`` queries" is
    always well defined, whatever the phase and the cadence.
    """

    def __init__(self, window: int, head_dim: int):
        self.window = window
        self.scaling = 1.0 / math.sqrt(head_dim)
        #: ``[L, H_q, w, d]``: every layer's window in one tensor, so a decode step appends with one cat
        self.queries: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def filled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(queries, positions)`` once a pass has been pushed."""
        assert self.queries is not None and self.positions is not None, "no pass observed yet"
        return self.queries, self.positions

    def push(self, obs: Observation) -> None:
        w = self.window
        queries = obs.queries
        assert queries is not None, "needs.queries is declared"
        new = queries[:, :, -w:] if isinstance(queries, torch.Tensor) else torch.stack([q[:, -w:] for q in queries])
        pos = obs.new_positions[-w:]
        if self.queries is None or pos.shape[0] >= w:
            self.queries, self.positions = new, pos
        else:
            assert self.positions is not None  # set together with queries
            self.queries = torch.cat([self.queries, new], dim=2)[:, :, -w:]
            self.positions = torch.cat([self.positions, pos])[-w:]

    @staticmethod
    def push_all(windows: list[QueryWindow], observations: Sequence[Observation]) -> None:
        """``windows[i].push(observations[i])`` for every i: full windows of equal size taking one query
        each (a decode step) shift together, in one operation for the batch (the same values as
        ``push``'s, which cuts the oldest query off each)."""
        shifting: dict[int, list[int]] = {}
        for i, (window, obs) in enumerate(zip(windows, observations)):
            if (
                window.queries is not None
                and window.queries.shape[2] == window.window
                and obs.new_positions.shape[0] == 1
            ):
                shifting.setdefault(window.window, []).append(i)
            else:
                window.push(obs)
        for members in shifting.values():
            if len(members) == 1:
                windows[members[0]].push(observations[members[0]])
                continue
            old = torch.stack([windows[i].filled()[0] for i in members])  # [n, L, H_q, w, d]
            new = torch.stack([stacked_layers(observations[i].queries)[:, :, -1:] for i in members])
            queries = torch.cat([old[:, :, :, 1:], new], dim=3).unbind(0)
            old_pos = torch.stack([windows[i].filled()[1] for i in members])
            new_pos = torch.stack([observations[i].new_positions for i in members]).to(old_pos.device)
            positions = torch.cat([old_pos[:, 1:], new_pos], dim=1).unbind(0)
            for i, q, p in zip(members, queries, positions):
                windows[i].queries, windows[i].positions = q, p


class ObservesQueryWindow(EvictionMethod):
    """Mixin of a method that scores with its most recent post-RoPE queries (SnapKV's observation
    window; it declares ``Needs(queries=True)`` and the field named by ``window_field`` holding how
    many): kept in a :class:`QueryWindow` for the whole sequence."""

    window_field: ClassVar[str] = "window"

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.queries = QueryWindow(getattr(self, self.window_field), info.head_dim)

    def observe(self, obs: Observation) -> None:
        self.queries.push(obs)

    @classmethod
    def observe_batch(cls, methods, observations) -> None:
        if cls.observe is not ObservesQueryWindow.observe:
            return super().observe_batch(methods, observations)
        QueryWindow.push_all([m.queries for m in methods], observations)


class ObservesTogether(EvictionMethod):
    """Mixin of a method whose ``observe`` is :meth:`observe_together` of one sequence: a batch's
    sequences are observed by one call of it (unless a subclass overrides ``observe``), so a sequence
    gets the same arithmetic alone and batched."""

    def observe(self, obs: Observation) -> None:
        type(self).observe_together([self], [obs])

    @classmethod
    def observe_batch(cls, methods, observations) -> None:
        if cls.observe is not ObservesTogether.observe:
            return super().observe_batch(methods, observations)
        cls.observe_together(methods, observations)

    @classmethod
    def observe_together(cls, methods, observations) -> None:
        """``methods[i]`` observes ``observations[i]``, for every i."""
        raise NotImplementedError


class ScoresOnHost(EvictionMethod):
    """Mixin of a method that scores from its cache's token positions on the host and its own state
    there (:meth:`score_on_host`): a sequence alone copies its positions to the host, a batch's rows of
    equal length copy theirs in one copy (:func:`positions_on_host`)."""

    #: the prompt flags come along (``score_on_host``'s ``prompt``)
    prompt_on_host: ClassVar[bool] = False

    def score(self, cache: CacheView) -> torch.Tensor:
        (row,), top = positions_on_host([cache], with_prompt=self.prompt_on_host)
        return self._score_row(row, cache, top)

    @classmethod
    def score_batch(cls, methods, caches: BatchCacheView) -> list[torch.Tensor]:
        if cls.score is not ScoresOnHost.score or not caches.equal_lengths:
            return super().score_batch(methods, caches)
        host, top = positions_on_host(caches.views, with_prompt=cls.prompt_on_host)
        return [m._score_row(row, view, top) for m, row, view in zip(methods, host, caches.views)]

    def _score_row(self, row: torch.Tensor, cache: CacheView, top: int | None) -> torch.Tensor:
        if self.prompt_on_host:
            return self.score_on_host(row[0], cache, top, row[1].bool())
        return self.score_on_host(row, cache, top)

    def score_on_host(
        self, positions: torch.Tensor, cache: CacheView, top: int | None, prompt: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The scores of ``cache``'s slots from their ``positions`` (``[T]``, on the host; ``top`` their
        largest) and, with ``prompt_on_host``, their ``prompt`` flags (on the host)."""
        raise NotImplementedError


def layer_mean_row(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, L, H_q, T]`` newest-query attention rows -> ``[n, T]``: per layer the mean over query heads,
    then the mean over layers, in ``dtype``. The EpiKV authors' harness averages HF's eager weights
    ``[1, H_q, q, T]`` per layer (``a.mean(dim=(0, 1))[-1, :]``, stacked and averaged), which are in the
    model's dtype (the engine hands them over as float32, exactly); reduced in that dtype here, the rows
    round as theirs."""
    return rows.to(dtype).mean(dim=2).mean(dim=1)


@dataclass
class NotableAttention(ObservesTogether, EvictionMethod):
    """Base of the methods that track when a cached token last drew notable attention (RaaS, LazyEviction):
    the newest query's weight on it, averaged over layers and query heads, above ``alpha`` / n (n = the
    cached keys it sees; ``alpha = 1``: above uniform)."""

    needs = Needs(attention=True, attention_window=1)

    alpha: float = 1.0

    def __post_init__(self) -> None:
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")

    def note(self, new: np.ndarray, attended: np.ndarray, now: float) -> None:
        """Record one pass: its new tokens' positions ``new``, the positions ``attended`` of the cached
        tokens its newest query (at position ``now``) attends to notably."""
        raise NotImplementedError

    @classmethod
    def observe_together(cls, methods, observations) -> None:
        """Every sequence's notable slots from one reduction per group and one copy to the host."""

        def notable(rows: torch.Tensor, i: int) -> list[torch.Tensor]:
            row = rows.mean(dim=(1, 2))  # [n, T]
            # compared in the rows' dtype, as a tensor with a Python threshold is
            return [row > methods[i].alpha / row.shape[-1]]

        for members, new, cached, (hit,) in newest_on_host(observations, [m.alpha for m in methods], notable):
            for i, new_i, cached_i, hit_i in zip(members, new, cached, hit):
                methods[i].note(new_i, cached_i[hit_i != 0], float(new_i[-1]))


def pool(scores: torch.Tensor, kernel: int, how: str = "avg") -> torch.Tensor:
    """Stride-1 pooling along the last dim of ``[N, T]`` with zero padding ``kernel // 2`` at each end.

    ``avg`` counts the padding (as ``F.avg_pool1d`` does by default); ``max`` pads with zeros too
    (scores are non-negative, so this equals ignoring the padding).
    """
    if kernel <= 1:
        return scores
    if how == "avg":
        return F.avg_pool1d(scores[:, None], kernel_size=kernel, stride=1, padding=kernel // 2)[:, 0]
    return F.max_pool1d(scores[:, None], kernel_size=kernel, stride=1, padding=kernel // 2)[:, 0]


def window_importance(
    window: QueryWindow, cache: CacheView, kernel: int, how: str = "avg", ordered: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """SnapKV's importance ``[L, H_kv, T]`` and the ``[L, H_kv, T]`` mask of the window's own slots.

    Per layer: mean over the window's queries of their attention, the window's own slots set to 0,
    pooled along the positions, then averaged over each GQA group (:func:`importance_of`, a batch of
    one: the same arithmetic as :func:`window_importance_batch`)."""
    scores, own = importance_of(window_attention(window, cache), kernel, how, ordered)
    return scores[0], own[0]


def window_importance_batch(
    windows: list[QueryWindow],
    caches: BatchCacheView,
    members: list[int],
    kernel: int,
    how: str = "avg",
    ordered: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`window_importance` of the sequences ``members`` of a batch, which hold equal numbers of
    slots and equal window fills (:func:`window_attention_batch`). ``[n, L, H_kv, T]`` importance and
    the ``[n, L, H_kv, T]`` mask of the window's own slots."""
    return importance_of(window_attention_batch(windows, caches, members), kernel, how, ordered)


def importance_of(
    attention: Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], kernel: int, how: str, ordered: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """SnapKV's importance from a window's attention, chunk by chunk of layers (as the window
    attention yields them): ``[n, L, H_kv, T]`` and the mask of the window's own slots. ``ordered``:
    the slots are in position order (the engine's contract); else they are put in that order to be
    pooled over neighbouring positions, and back."""
    scores, owns = [], []
    for attn, key_pos, query_pos in attention:
        n, c, h_q, _, t = attn.shape
        group = h_q // key_pos.shape[2]
        own = key_pos >= query_pos[:, :1, None, None]  # the window's own slots
        attn = attn.mean(dim=3).masked_fill(own.repeat_interleave(group, dim=2), 0.0)  # [n, c, H_q, T]
        if ordered:
            pooled = pool(attn.reshape(n * c * h_q, t), kernel, how)
        else:
            order = key_pos.expand(n, c, -1, t).argsort(dim=-1).repeat_interleave(group, dim=2)
            by_position = pool(attn.gather(-1, order).reshape(n * c * h_q, t), kernel, how)
            pooled = torch.empty_like(attn).scatter_(-1, order, by_position.view(n, c, h_q, t))
        scores.append(pooled.view(n, c, -1, group, t).mean(dim=3))
        owns.append(own)
    if len(scores) == 1:
        return scores[0], owns[0]
    return torch.cat(scores, dim=1), torch.cat(owns, dim=1)


def window_attention(
    window: QueryWindow, cache: CacheView
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`window_attention_batch` of one sequence (``n`` = 1): its layers' keys stacked a chunk
    at a time."""
    keys = cache.keys
    h_kv, t, d = keys[0].shape
    return _window_attention(
        [window], lambda part: torch.stack(keys[part])[None], cache.positions.stacked[None], len(keys), h_kv * t * d
    )


def window_attention_batch(
    windows: list[QueryWindow], caches: BatchCacheView, members: list[int]
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The window attention of the sequences ``members`` of a batch, which hold equal numbers of slots
    and equal window fills (:func:`_window_attention`), for as many layers at once as keep the float32 work under
    ``contract.STACK_BYTES`` (one batched matmul each). Per chunk of c layers: the attention ``[n, c,
    H_q, w, T]``, the slots' positions ``[n, c, H_kv, T]`` and the window's ``[n, w]``."""
    keys = caches.stacked_of(members, 0)  # [L, n, H_kv, T, d]
    n_layers, n, h_kv, t, d = keys.shape
    key_pos = torch.stack([caches.views[i].positions.stacked for i in members])  # [n, L, H_kv, T]
    # contiguous: a matmul over a strided view of several layers takes another GEMM path, whose
    # float32 bits differ from one layer's alone
    return _window_attention(
        windows, lambda part: keys[part].transpose(0, 1).contiguous(), key_pos, n_layers, n * h_kv * t * d
    )


def _window_attention(
    windows: list[QueryWindow],
    keys_of: Callable[[slice], torch.Tensor],
    key_pos: torch.Tensor,
    n_layers: int,
    key_elements: int,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The windows' attention over ``keys_of(layers)`` (``[n, c, H_kv, T, d]``, contiguous) and the
    slots' positions ``key_pos`` ``[n, L, H_kv, T]``, per chunk of layers; ``key_elements``: one
    layer's keys, for the chunks' size (the keys in float32, the scores and their softmax). Causal by
    absolute position: a query at position p sees the cached keys at positions <= p; a query whose
    every earlier key was evicted sees none, and its row is all zeros (not NaN)."""
    queries = torch.stack([w.filled()[0] for w in windows])  # [n, L, H_q, w, d]
    n, _, h_q, w, _ = queries.shape
    query_pos = torch.stack([w.filled()[1] for w in windows]).to(key_pos.device)  # [n, w]
    t = key_pos.shape[-1]
    for part in chunks(n_layers, 4 * (key_elements + 2 * n * h_q * w * t)):
        pos = key_pos[:, part]
        future = pos[:, :, :, None, None, :] > query_pos[:, None, None, None, :, None]  # [n, c, H_kv, 1, w, T]
        attn = attention_rows(queries[:, part], keys_of(part), windows[0].scaling, future)
        yield attn.nan_to_num_(0.0), pos, query_pos


def check_window_kernel(window: int, kernel: int) -> None:
    """The observation window (>= 1 queries) and the pooling kernel (odd, so it centres on a token) of
    the SnapKV-style methods."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be a positive odd integer, got {kernel}")


def top_by_score_then_position(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest ``scores``; equal scores: the larger position first (deterministic).

    Two stable sorts (positions are distinct), no Python loop over the slots; ``+ 0.0`` makes -0.0 equal
    to 0.0, as a comparison does."""
    by_position = torch.argsort(positions, descending=True, stable=True)
    return by_position[torch.argsort(scores[by_position] + 0.0, descending=True, stable=True)][:k]


def segment_bounds(length: int, segment: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` runs of ``segment`` slots covering ``0..length``; the last may be shorter."""
    return [(start, min(start + segment, length)) for start in range(0, length, segment)]


def tertile_types(values: list[float], descending: bool = False) -> list[int]:
    """Type 0 (R), 1 (E) or 2 (T) of each value by tertile thresholds of the sorted values.

    t_low = sorted[S // 3], t_high = sorted[2S // 3]. Ascending (ThinKV, entropy): v <= t_low -> 0,
    v <= t_high -> 1, else 2. Descending (EpiKV-Seg, key variance): v >= t_high -> 0, v >= t_low -> 1,
    else 2. One value: type 0."""
    n = len(values)
    if n <= 1:
        return [0] * n
    ordered = sorted(values)
    low, high = ordered[n // 3], ordered[(2 * n) // 3]
    if descending:
        return [0 if v >= high else (1 if v >= low else 2) for v in values]
    return [0 if v <= low else (1 if v <= high else 2) for v in values]


def rank_within(groups: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Rank (0 = highest score; ties by slot order) of each element inside its group ``0..G-1``."""
    order = torch.argsort(-scores, stable=True)
    order = order[torch.argsort(groups[order], stable=True)]
    counts = torch.bincount(groups)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0]) - starts[groups[order]]
    return rank


def rank_in_unit(x: torch.Tensor) -> torch.Tensor:
    """Order-preserving map of float64 ``x`` into [0, 1) (rank / T), so tiers never overlap."""
    t = x.shape[0]
    order = torch.argsort(x, stable=True)
    out = torch.empty(t, dtype=torch.float64)
    out[order] = torch.arange(t, dtype=torch.float64) / max(t, 1)
    return out
