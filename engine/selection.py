"""Which slots an eviction keeps: the protocol's protected tiers (prompt, sink, recent window) above
the method's scores, and a deterministic top-k of them that reads nothing on the host."""

from __future__ import annotations

import numpy as np
import torch

from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import Protocol


def in_window(pos: torch.Tensor, protocol: Protocol, current_position, recent) -> torch.Tensor:
    """The sink and recent-window slots (not the prompt); ``current_position`` and ``recent`` are
    numbers, or per-row tensors broadcast against ``pos``."""
    return (pos < protocol.sink) | (pos > current_position - recent)


def tiers(scores: torch.Tensor, window: torch.Tensor, prompt_tier: torch.Tensor) -> torch.Tensor:
    """What the engine ranks: protected prompt (+inf) > sink / recent window (the largest finite
    value) > the method's scores, capped just below it (its own +inf included); equal scores keep
    the more recent position (:func:`keep_top`)."""
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    top = torch.finfo(scores.dtype).max
    as_numpy = np.dtype(str(scores.dtype).removeprefix("torch.")).type  # no tensor for the host to read
    below_top = float(np.nextafter(as_numpy(top), as_numpy(0)))
    ranked = torch.where(window, top, scores.clamp(max=below_top))
    return torch.where(prompt_tier, float("inf"), ranked)


def check_read(nan: int, n_protected: int, budget: int, protocol: Protocol) -> None:
    """What an eviction read of its scores refuses: a NaN score, protected slots over the budget."""
    if nan:
        raise KvleagueError("score: the method returned NaN scores")
    check_protected(n_protected, budget, protocol)


def check_protected(n_protected: int, budget: int, protocol: Protocol) -> None:
    if n_protected > budget and protocol.prompt_over_budget != "keep":
        raise KvleagueError(
            f"budget: {n_protected} protected tokens (sink + recent + prompt) exceed the budget {budget}; "
            "raise the budget, turn off protect_prompt, or use prompt_over_budget: keep"
        )


def ranking_decided(length: int, kept: int, n_protected: int) -> bool:
    """The method's ranking decided an eviction only when some of its candidates stay and some go;
    otherwise the protocol alone chose (nothing to drop, or every candidate dropped)."""
    return 0 < length - kept < length - n_protected


def agreement(keep: torch.Tensor) -> torch.Tensor:
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


def first_dropped(keep: torch.Tensor) -> int:
    """The earliest slot that any row of keep mask ``keep`` (``[..., T]``) drops: every slot before
    it stays where it is (0 when a row drops none of its ``T`` slots). One host read."""
    return int((~keep).to(torch.uint8).argmax(dim=-1).min())


def keep_top(ranked: torch.Tensor, kept, positions: torch.Tensor) -> torch.Tensor:
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
