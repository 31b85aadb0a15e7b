"""Softmax attention rows computed from queries and keys, with torch alone: what the probe
(``probe.py``, inside transformers' forward) records and what methods recompute from kept queries.
No transformers here, so that ``methods/`` import without it (a sweep's driver checks a config
by building its methods)."""

from __future__ import annotations

import torch


def attention_rows(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, future: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal softmax rows of ``w`` queries ``[H_q, w, d]`` over keys ``[H_kv, T, d]``.

    By default the queries are the newest: query i of the window sits at storage slot ``T - w + i``
    and sees slots ``<= T - w + i``. ``future`` (bool, broadcastable to ``[H_kv, group, w, T]``, True =
    hidden) replaces that rule, e.g. causality by absolute position for queries kept from earlier steps.
    Returns float32 ``[H_q, w, T]`` (with ``query`` ``[..., H_q, w, d]`` and ``keys`` ``[..., H_kv, T, d]``,
    ``[..., H_q, w, T]``). The query heads of each GQA group share one matmul against
    their KV head (``[H_kv, group * w, d] @ [H_kv, d, T]``), so K is never repeated per query head.
    """
    *lead, h_q, w, d = query.shape  # leading dimensions (a batch): each its own keys
    h_kv, t = keys.shape[-3], keys.shape[-2]
    q = query.float().reshape(*lead, h_kv, (h_q // h_kv) * w, d)  # query head j belongs to KV head j // group
    k = keys if keys.dtype == torch.float32 else keys.float()
    scores = torch.matmul(q, k.transpose(-1, -2)).view(*lead, h_q, w, t)
    scores.mul_(scaling)
    if future is not None:
        scores.view(*lead, h_kv, h_q // h_kv, w, t).masked_fill_(future, float("-inf"))
    elif w > 1:
        slots = torch.arange(t, device=scores.device)
        last_visible = torch.arange(t - w, t, device=scores.device)
        scores.masked_fill_(slots[None, :] > last_visible[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1)
