"""The budgeted cache's bookkeeping and eviction for a batch's rows at once (``decode.py``): one
concatenation for a decode step's new slots, one selection and one gather for the rows' evictions."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvleague.engine.cache import BudgetedCache
from kvleague.engine.compaction import fill_slab_holes, gather_slots, row_order
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import Protocol
from kvleague.engine.selection import (
    agreement,
    check_protected,
    first_dropped,
    in_window,
    keep_top,
    ranking_decided,
    tiers,
)
from kvleague.engine.to_device import to_device


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
        new = positions if at == list(range(positions.shape[0])) else positions[to_device(at, positions.device)]
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
    keeps_fewer: bool = True,
) -> list[int] | None:
    """:meth:`BudgetedCache.evict` for several caches at once, each the row ``rows[i]`` of the batched
    slabs ``kv`` (every layer's keys and values, ``[L, 2, N, H, capacity, d]``; ``decode.py``), each with
    its own length and budget: one selection over the stacked (padded) scores and one gather for all
    of them (:func:`gather_slots`), and one host read per call whatever the batch size (the rows'
    counts of prompt, protected and keepable slots, which fix how many each keeps). The same kept slots, slot order
    and bookkeeping as evicting each on its own. Returns the dropped count per cache, or None
    (nothing changed) where the rows do not share one plan shape (different score shapes, a row whose
    heads or layers differ where its scores do not, a ``-inf`` score that would leave fewer than the
    budget): the caller then evicts each alone. ``keeps_fewer=False`` (methods that never score
    -inf): each row's count is known on the host and no read is made here; the checks, ``ranked`` and
    the keep masks' agreement are posted (:meth:`BudgetedCache.evict`)."""
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

    stacked = to_device(padded(scores, float("-inf")), first.device)  # [N, (L, (H,)) t]: one copy to the device
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
    meta = to_device([lengths, current_positions, [protocol.recent_for(b) for b in budgets]], device)
    length_t, current, recent = (row.view(n, *lead) for row in meta)
    valid = torch.arange(t, device=device) < length_t
    window = in_window(pos, protocol, current, recent) & valid
    prompt_tier = prompt if protocol.protect_prompt else torch.zeros_like(prompt)
    ranked = tiers(stacked, window, prompt_tier)
    n_protected = (window | prompt_tier).sum(dim=-1).reshape(n, -1).max(dim=1).values  # most over layers and heads
    keepable = ((ranked != float("-inf")) & valid).sum(dim=-1).reshape(n, -1).min(dim=1).values  # fewest
    nan = torch.isnan(stacked).reshape(n, -1).any(dim=1)
    if keeps_fewer:
        # per row: prompt slots, protected slots, fewest keepable, and whether a score is NaN: one host read
        counts = torch.stack(
            [prompt_tier.sum(dim=-1).reshape(n, -1).max(dim=1).values, n_protected, keepable, nan.long()]
        ).tolist()
        if any(counts[3]):
            raise KvleagueError("score: the method returned NaN scores")
        n_prompt = counts[0] if protocol.protect_prompt else [0] * n
        kept = [max(b, p) for b, p in zip(budgets, n_prompt)]
        if any(keepable < min(k, length) for keepable, k, length in zip(counts[2], kept, lengths)):
            return None  # a -inf score asks for fewer slots than the budget: evict() settles that row by row
        for protected, budget in zip(counts[1], budgets):
            check_protected(protected, budget, protocol)
        kept = [min(k, length) for k, length in zip(kept, lengths)]  # a row that keeps all drops nothing
        for c, k, length, protected in zip(caches, kept, lengths, counts[1]):
            c.ranked_evictions += ranking_decided(length, k, protected)
    else:  # every row keeps max(budget, its fed slots under protect_prompt): known here
        kept = [
            min(max(b, c.prompt_fed if protocol.protect_prompt else 0), t) for b, c, t in zip(budgets, caches, lengths)
        ]
    kept_t = to_device(kept, device)  # one copy to the device
    if not keeps_fewer:
        found = torch.stack([nan.long(), n_protected, (keepable < kept_t).long()], dim=1)
        BudgetedCache.post_checks(found, budgets, kept, lengths, protocol, caches)
    if kept == lengths:
        return [0] * n
    k_max = max(kept)
    keep_n = kept_t.view(n, *lead)
    keep = keep_top(ranked, keep_n, pos)  # [N, (L, (H,)) t]; padding never kept
    order = row_order(keep, keep_n, k_max, ordered)  # [N, (L, (H,)) k_max]: each row's own plan, padded
    contiguous = rows == list(range(rows[0], rows[0] + n))
    index = None if contiguous else to_device(rows, device)  # None: the rows are one slice
    part = kv[:, :, rows[0] : rows[0] + n] if index is None else kv.index_select(2, index)  # [L, 2, n, H, capacity, d]
    if ordered:
        # every slot before the first dropped one (of any row, layer or head) stays where it is: on a
        # CPU only the slots from there on move (a few, where a method drops recent tokens); on a GPU
        # all move, since reading where that slot is would make the host wait for the device
        start = first_dropped(keep) if device.type == "cpu" else 0
        # slots past a row's own count take whatever its padded order names: past its new length
        gather_slots(part, order[..., start:], start, t)
    else:  # the holes below each row's count alone take its kept slots above it
        fill_slab_holes(part, keep, keep_n, max(length - k for length, k in zip(lengths, kept)))
    if index is not None:  # a copy of the rows: written back
        kv.index_copy_(2, index, part)
    if dim == 1:
        at = order[:, None, :].expand(n, first.n_kv_heads, k_max)
        new_pos, new_prompt = base_pos.gather(2, at), base_prompt.gather(2, at)
        for c, row_pos, row_prompt in zip(caches, _rows(new_pos, kept), _rows(new_prompt, kept)):
            c._set(row_pos, row_prompt, True)
    else:
        at = order[:, :, None, :].expand(n, first.n_layers, first.n_kv_heads, k_max) if order.dim() == 3 else order
        new_pos, new_prompt = full_pos.gather(3, at), full_prompt.gather(3, at)
        if not keeps_fewer:  # the keep masks' agreement read later; a uniform row's first layer copied now
            rows_kept = list(zip(_rows(new_pos, kept), _rows(new_prompt, kept)))
            uniform = any(c.uniform for c in caches)
            firsts = (
                list(zip(_rows(new_pos[:, 0].clone(), kept), _rows(new_prompt[:, 0].clone(), kept)))
                if uniform
                else None
            )
            BudgetedCache.finish_later(caches, rows_kept, agreement(keep), dim == 2, firsts)
            return _truncated(caches, kept, lengths)
        heads_same, layers_same = agreement(keep).tolist()
        # a row that stays uniform keeps a copy of its first layer's: cut for the batch at once
        stays = any(c.uniform and h and l for c, h, l in zip(caches, heads_same, layers_same))
        firsts = zip(_rows(new_pos[:, 0].clone(), kept), _rows(new_prompt[:, 0].clone(), kept)) if stays else [None] * n
        for r, (c, row_pos, row_prompt, first_layer) in enumerate(
            zip(caches, _rows(new_pos, kept), _rows(new_prompt, kept), firsts)
        ):
            c._finish(row_pos, row_prompt, heads_same[r], layers_same[r], first_layer)
    return _truncated(caches, kept, lengths)


def _truncated(caches: list[BudgetedCache], kept: list[int], lengths: list[int]) -> list[int]:
    """Each cache's layers cut to its ``kept`` slots; the dropped count per cache."""
    for c, k in zip(caches, kept):
        for layer in c.slab_layers:
            layer.truncate(k)
    return [length - k for length, k in zip(lengths, kept)]


def _rows(padded: torch.Tensor, kept: list[int]) -> Sequence[torch.Tensor]:
    """Row r of ``padded`` (``[N, ..., k_max]``) cut to its ``kept[r]`` slots: one slice and one unbind
    where every row keeps as many (not two views per row)."""
    if len(set(kept)) == 1:
        return padded[..., : kept[0]].unbind(0)
    return [padded[r, ..., :k] for r, k in enumerate(kept)]
