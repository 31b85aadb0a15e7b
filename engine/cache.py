"""A transformers ``DynamicCache`` with slab-backed layers, plus the bookkeeping eviction needs.

For every layer it tracks, slot by slot, the absolute position of the token held there and whether
that token was fed (prompt) or generated. Eviction selects per layer and KV head and **physically
removes** the dropped slots, so memory really shrinks. The pieces live beside it: the slab layers
(``cache_layers.py``), the selection (``selection.py``), how kept slots move (``compaction.py``),
and a batch's rows at once (``cache_rows.py``).

Speed (see ``runner/bench/decode_speed.py``): a decode step writes the new entry in place in a
preallocated slab, and an eviction moves only what it must (``compaction.py``). A slab shrinks back
to its reserve once a long prompt has been compressed, so memory does shrink.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from kvleague.engine import deferred_reads
from kvleague.engine.cache_layers import SlabLayer, held, slab_cache
from kvleague.engine.compaction import Plan, fill_holes, row_order, shift_left
from kvleague.engine.contract import CacheView, PerLayer, Phase
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import Protocol
from kvleague.engine.selection import agreement, check_read, in_window, keep_top, ranking_decided, tiers
from kvleague.engine.to_device import to_device

#: ordered removal of at most this many slots per head moves the tail in place (CPU memmove)
_MEMMOVE_MAX = 16


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
        #: evictions decided by the method's ranking (not by the protocol alone), counted as read
        self.ranked_evictions = 0
        #: tokens fed (prompt) so far: under ``protect_prompt`` every one of them stays in the cache
        self.prompt_fed = 0

    # -- bookkeeping --------------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._pos.shape[-1]

    @property
    def slab_layers(self) -> list[SlabLayer]:
        """The layers, where every one is a :class:`SlabLayer`: a batch's rows (``decode.py`` checks
        each sequence that joins one) and the slab store's (it holds no other kind)."""
        return cast("list[SlabLayer]", self.cache.layers)  # Hugging Face types them as its base layer class

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
        self._pos, self._prompt, self.uniform = pos, prompt, uniform
        self._views = [None, None]
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
        for layer, (keys, values) in zip(self.slab_layers, layers):
            layer.bind(keys, values, self.length)

    def kv_bytes(self) -> int:
        """Bytes of the K/V entries held (slots x layers x heads x head dim x 2 x element size)."""
        if not self.bytes_per_slot:
            per_slot = 0
            for layer in self.cache.layers:
                keys = layer.keys
                if layer.is_initialized and keys is not None and keys.dim() >= 2 and keys.shape[-2]:
                    values = held(layer.values)
                    per_slot += keys.nbytes // keys.shape[-2] + values.nbytes // max(1, values.shape[-2])
            self.bytes_per_slot = per_slot
        return self.bytes_per_slot * self.length

    def track(self, new_positions: torch.Tensor, prompt: bool) -> None:
        """Record the slots the last forward pass appended (call right after it)."""
        c = new_positions.shape[0]
        self.prompt_fed += c if prompt else 0
        pos = to_device(new_positions, self.device).expand(*self._pos.shape[:-1], c)
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
        return [held(layer.keys if which == 0 else layer.values)[0] for layer in self.cache.layers]

    def _protected(
        self, pos: torch.Tensor, prompt: torch.Tensor, protocol: Protocol, current_position: int, budget: int
    ) -> torch.Tensor:
        return in_window(pos, protocol, current_position, protocol.recent_for(budget)) | (
            prompt if protocol.protect_prompt else False
        )

    def protected(self, protocol: Protocol, current_position: int, budget: int) -> list[torch.Tensor]:
        """Per layer ``[H, T]``: slots the protocol forbids evicting."""
        return [
            self._protected(p, f, protocol, current_position, budget) for p, f in zip(self.positions, self.is_prompt)
        ]

    # -- eviction -------------------------------------------------------------------------------

    def evict(
        self,
        scores: torch.Tensor,
        budget: int,
        protocol: Protocol,
        current_position: int,
        ordered: bool = True,
        keeps_fewer: bool = True,
    ) -> int:
        """Keep the ``budget`` best slots (protected ones first); return how many slots were dropped.

        A slot the method scores -inf is dropped even when fewer than ``budget`` slots then remain
        (protected slots excepted); every layer and KV head must then keep the same number of slots.
        ``ordered=False`` lets the kept slots change order (see the module docstring).
        ``keeps_fewer=False`` (a method that never scores -inf, ``Needs.keeps_fewer``): the kept count
        is known on the host, and the eviction's checks are read later (``deferred_reads``)."""
        length = self.length
        scores = to_device(self._normalise(scores, length), self.device)  # scores made on the host: not blocking
        if scores.dim() == 1 and not self.uniform:
            raise KvleagueError("score: per-token scores [T] need every layer and head to hold the same tokens")
        if scores.dim() == 2 and not self.heads_agree:
            scores = scores[:, None, :].expand(self.n_layers, self.n_kv_heads, length)
        pos, prompt = self._ranking_layout(scores.dim())
        window = in_window(pos, protocol, current_position, protocol.recent_for(budget))
        prompt_tier = prompt if protocol.protect_prompt else torch.zeros_like(prompt)
        ranked = tiers(scores, window, prompt_tier)
        if not keeps_fewer:
            return self._evict_known(scores, ranked, window, prompt_tier, budget, protocol, pos, ordered)
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
        check_read(nan, n_protected, budget, protocol)
        # prompt_over_budget "keep": the whole prompt stays even beyond B (then nothing else does)
        kept = max(budget, n_prompt)
        if kept >= length:
            return 0
        if fewest < kept:
            if scores.dim() > 1 and fewest != most:
                raise KvleagueError(
                    "score: -inf (must drop) leaves a different number of slots in different layers or heads; "
                    "every layer and KV head of a cache holds the same number of slots"
                )
            kept = fewest
        self.ranked_evictions += ranking_decided(length, kept, n_protected)
        self._keep(keep_top(ranked, kept, pos), kept, ordered, deferred=False)
        return length - kept

    def _evict_known(self, scores, ranked, window, prompt_tier, budget: int, protocol: Protocol, pos, ordered) -> int:
        """:meth:`evict` for a method that never scores -inf: every layer and head keeps
        ``max(budget, prompt slots)`` (the prompt's slots are the fed ones, all kept, under
        ``protect_prompt``), known on the host; the checks an eager read makes (a NaN score, protected
        slots over the budget, a -inf score) and the ``ranked`` flag are posted, read with the host's
        next read (:mod:`~engine.deferred_reads`)."""
        length = self.length
        kept = max(budget, self.prompt_fed if protocol.protect_prompt else 0)
        n_protected = (window | prompt_tier).sum(dim=-1).max()
        found = torch.stack(
            [
                torch.isnan(scores).any().long(),
                n_protected,
                ((ranked != float("-inf")).sum(dim=-1) < min(kept, length)).any().long(),
            ]
        )
        self.post_checks(found, [budget], [min(kept, length)], [length], protocol, [self])
        if kept >= length:
            return 0
        self._keep(keep_top(ranked, kept, pos), kept, ordered, deferred=True)
        return length - kept

    @staticmethod
    def post_checks(found, budgets, kept, lengths, protocol: Protocol, caches: list[BudgetedCache]) -> None:
        """Post ``found`` (``[3 * N]``: per cache, NaN, protected slots, a -inf score) to be read with
        the host's next read, which then raises what an eager read would have, and counts the
        evictions the method's ranking decided."""

        def then(values: list[int]) -> None:
            for r, c in enumerate(caches):
                nan, n_protected, dropped = values[3 * r : 3 * r + 3]
                check_read(nan, n_protected, budgets[r], protocol)
                if dropped:
                    raise KvleagueError(
                        "score: -inf (must drop) from a method that does not declare Needs(keeps_fewer=True); "
                        "a method that keeps fewer than B slots declares it"
                    )
                c.ranked_evictions += ranking_decided(lengths[r], kept[r], n_protected)

        deferred_reads.post(found, then)

    def _keep(self, keep: torch.Tensor, kept: int, ordered: bool, deferred: bool) -> None:
        """Move the ``kept`` slots of ``keep`` to the front and cut the bookkeeping to them. Per-layer
        or per-head masks: whether they agreed across heads and layers (the bookkeeping's layout) is
        read now, or with ``deferred`` posted, the bookkeeping staying per layer until it is read."""
        order = self._move_kept(keep, kept, ordered)  # the old slot of every new slot
        if keep.dim() == 1:  # one plan for every layer
            self._set(self._pos[:, order], self._prompt[:, order], True)
        else:
            pos, prompt = self._per_layer()
            index = order[:, None, :].expand(self.n_layers, self.n_kv_heads, kept) if order.dim() == 2 else order
            new_pos, new_prompt = pos.gather(2, index), prompt.gather(2, index)
            if deferred:
                self.finish_later([self], [(new_pos, new_prompt)], agreement(keep[None]), keep.dim() == 2)
            else:
                heads_same, layers_same = agreement(keep[None]).tolist()
                self._finish(new_pos, new_prompt, heads_same[0], layers_same[0])
        self._shrink(kept)

    @staticmethod
    def finish_later(
        caches: Sequence[BudgetedCache],
        rows: Sequence[tuple[torch.Tensor, torch.Tensor]],
        same: torch.Tensor,
        heads_known: bool,
        firsts: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """:meth:`_finish` for each cache with its new ``(positions, prompt flags)`` while the
        agreement flags ``same`` (``[2, N]``: heads, layers; :func:`agreement`) are still on the
        device: the bookkeeping is stored per layer now (it holds the same positions either way) and
        collapsed as :meth:`_finish` would have when they are read, in one post for the caches. Nothing
        but appends (one position added to every layer and head) changes it before then: the decode
        loop reads what is posted before its next eviction. ``heads_known``: ``[L, T]`` scores, whose
        heads agree. ``firsts``: a copy of each row's first layer made already (a batch's, made for
        every row at once), which a cache that stays uniform keeps."""
        before = [(c.uniform, c.heads_agree) for c in caches]
        for c, (pos, prompt), (_, agreeing) in zip(caches, rows, before):
            c._set(pos, prompt, False)
            c._heads_agree = agreeing and heads_known

        def then(values: list[int]) -> None:
            n = len(caches)
            for r, (c, (uniform, agreeing)) in enumerate(zip(caches, before)):
                heads_agree = agreeing and bool(values[r])
                if uniform and heads_agree and values[n + r]:
                    c._set(*(firsts[r] if firsts is not None else (c._pos[0].clone(), c._prompt[0].clone())), True)
                c._heads_agree = heads_agree

        deferred_reads.post(same, then)

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
        :func:`agreement`). Layers (heads) that held the same slots still do when their masks were
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
            plan = Plan(keep, budget, ordered)
            for layer in self.cache.layers:
                self._evict_layer(layer, plan)
            return plan.order()
        for i, layer in enumerate(self.cache.layers):
            self._evict_layer(layer, Plan(keep[i], budget, ordered))
        return row_order(keep, budget, budget, ordered)

    def _evict_layer(self, layer, plan: Plan) -> None:
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
            fill_holes(layer.buffers, plan)
        elif layer.device.type == "cpu" and plan.length - budget <= _MEMMOVE_MAX:
            shift_left(layer.buffers, plan)
        else:
            self._compact(layer.buffers, plan)
        layer.truncate(budget)

    def _compact(self, buffers, plan: Plan) -> None:
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

    def expect(self, slots: int) -> None:
        """Room for ``slots`` entries where the store sizes its slabs ahead (the slab backend's: one
        size for a decode that never evicts, not a geometric growth while it runs); else nothing."""

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
