"""How the kept slots move to the front of a layer's K/V once selected (the plans), the same slot
layout on every path:

* **order-free** (methods with ``Needs.ordered_slots=False``): each dropped slot below the new
  length is refilled with a kept slot from above it, O(evicted) per step (:func:`fill_holes`);
* **ordered** (the default contract: slots stay in increasing position order): the kept slots after
  the first hole move left in place (a memmove per KV head on the CPU when few slots go,
  :func:`shift_left`, else a gather into a reused scratch buffer and back), O(cache after the first
  hole), with no allocation; :func:`gather_slots` does it for every layer of a slab at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvleague.engine.selection import first_dropped


def row_order(keep: torch.Tensor, kept, k_max: int, ordered: bool) -> torch.Tensor:
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
    ``GATHER_BYTES``."""
    at = _slab_index(order)
    n_layers, _, n, heads, _, head_dim = kv.shape
    width = order.shape[-1]
    chunk = max(1, GATHER_BYTES // max(2 * n * heads * width * head_dim * kv.element_size(), 1))
    for lo in range(0, n_layers, chunk):
        hi = min(lo + chunk, n_layers)
        slabs, index = (kv, at) if chunk >= n_layers else (kv[lo:hi], at if at.shape[0] == 1 else at[lo:hi])
        index = index.expand(hi - lo, 2, n, heads, width, head_dim)
        out = None if scratch is None else scratch(tuple(index.shape))
        slabs.narrow(-2, start, width).copy_(torch.gather(slabs.narrow(-2, 0, length), -2, index, out=out))


def _slab_index(order: torch.Tensor) -> torch.Tensor:
    """A per-row slot index ``[N, w]``, ``[N, L, w]`` or ``[N, L, H, w]`` as ``[L or 1, 1, N, H or 1,
    w, 1]``, broadcast over a slab's K / V and head dim."""
    if order.dim() == 2:
        return order[None, None, :, None, :, None]
    if order.dim() == 3:
        return order.transpose(0, 1)[:, None, :, None, :, None]
    return order.transpose(0, 1)[:, None, :, :, :, None]


def fill_slab_holes(kv: torch.Tensor, keep: torch.Tensor, kept, dropped: int) -> None:
    """Order-free removal in the slabs ``kv`` (``[L, 2, N, H, capacity, d]``) for keep masks ``[N, T]``,
    ``[N, L, T]`` or ``[N, L, H, T]`` whose rows keep ``kept`` slots (an int, or a count per row
    broadcast against the leading dims) and drop at most ``dropped`` of their own: each dropped slot
    below the row's count takes a kept slot from the count on, in increasing order on both sides
    (:func:`row_order`'s layout), and nothing else moves: ``dropped`` slots gathered and scattered,
    not the whole cache. Sorts of the masks, no host read."""
    if dropped == 0:
        return
    slots = torch.arange(keep.shape[-1], device=keep.device)
    first = lambda mask: mask.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)[..., :dropped]  # noqa: E731
    dropped_mask = ~keep
    holes = first(dropped_mask)  # a row's dropped slots ascending (its padding among them), then kept ones
    donors = first(keep & (slots >= kept))  # as many kept slots from the count on as holes below it
    # only a dropped slot below the count takes a donor; the rest copy themselves. A row that drops
    # fewer than ``dropped`` has kept slots at the end of ``holes`` (the sort's ties): they must stay.
    src = torch.where(dropped_mask.gather(-1, holes) & (holes < kept), donors, holes)
    at, src_at = _slab_index(holes), _slab_index(src)
    shape = (kv.shape[0], 2, kv.shape[2], kv.shape[3], holes.shape[-1], kv.shape[-1])
    kv.scatter_(-2, at.expand(shape), torch.gather(kv, -2, src_at.expand(shape)))


#: the most bytes one gather of the slabs' kept slots copies out (all layers, else a few at a time)
GATHER_BYTES = 64 << 20


class Plan:
    """How one layer's slots become the kept ones, for a keep mask ``[T]`` (all heads) or ``[H, T]``.

    Each piece is computed once on demand and shared by the K and V buffers (and, for token-level
    scores, by every layer)."""

    def __init__(self, keep: torch.Tensor, budget: int, ordered: bool):
        self.keep, self.budget, self.ordered = keep, budget, ordered
        self.length = keep.shape[-1]
        self._order: torch.Tensor | None = None
        self._gather: dict[tuple[int, ...], torch.Tensor] = {}
        self._holes_donors: tuple[torch.Tensor, torch.Tensor] | None = None
        self._drops: list[list[int]] | None = None
        self._tail: tuple[int, torch.Tensor | None] | None = None

    def order(self) -> torch.Tensor:
        """``[B]`` or ``[H, B]``: the old slot of every new slot."""
        if self._order is None:
            self._order = row_order(self.keep, self.budget, self.budget, self.ordered)
        return self._order

    def gather_index(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The index that gathers a ``shape`` (``[1, H, capacity, d]``) buffer's kept slots into
        ``[1, H, B, d]``: :meth:`order` expanded, shared by every buffer of that shape."""
        if shape not in self._gather:
            order = self.order()
            index = order[None, None, :, None] if order.dim() == 1 else order[None, :, :, None]
            self._gather[shape] = index.expand(shape[0], shape[1], self.budget, shape[-1])
        return self._gather[shape]

    def holes_donors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Order-free: dropped slots below B and the kept slots from B on that refill them.

        ``[k]`` slot indices for a ``[T]`` mask; ``[k, 2]`` (head, slot) pairs for ``[H, T]``."""
        if self._holes_donors is None:
            b = self.budget
            holes, donors = (~self.keep[..., :b]).nonzero(), self.keep[..., b:].nonzero()
            if self.keep.dim() == 1:
                holes, donors = holes[:, 0], donors[:, 0] + b
            else:
                donors = torch.stack([donors[:, 0], donors[:, 1] + b], dim=1)
            self._holes_donors = (holes, donors)
        return self._holes_donors

    def drops(self) -> list[list[int]]:
        """Per head (one list when all heads agree): the dropped slots, ascending."""
        if self._drops is None:
            rows = self.keep.reshape(-1, self.length)
            out: list[list[int]] = [[] for _ in range(rows.shape[0])]
            for r, slot in (~rows).nonzero().tolist():
                out[r].append(slot)
            self._drops = out
        return self._drops

    def tail(self) -> tuple[int, torch.Tensor | None]:
        """Ordered: the earliest hole over the heads, and the kept slots from it on (``[m]`` / ``[H, m]``)."""
        if self._tail is None:
            first = first_dropped(self.keep)
            m = self.budget - first
            tail = None
            if m > 0:
                tail = self.keep[..., first:].nonzero()[:, -1].view(*self.keep.shape[:-1], m) + first
            self._tail = (first, tail)
        return self._tail


def fill_holes(buffers, plan: Plan) -> None:
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


def shift_left(buffers, plan: Plan) -> None:
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
