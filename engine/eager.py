"""Eager attention under a memory budget: computed over chunks of queries, so that one layer's attention
buffers (scores, the float32 softmax, the weights cast back) never exceed the worker's share for them.

Transformers' eager kernel materializes ``[B, H_q, C, T]`` scores several times over for a prefill of C
queries over T keys (H2O's prefill at a few thousand tokens: gigabytes per layer). Here each chunk of
``c`` queries runs transformers' own steps (the same ops, the same dtypes) on ``[B, H_q, c, T]``, with
``c`` the most queries whose buffers fit :func:`budget_bytes`. What comes back is what the caller asked:

* ``"all"``: every weight, ``[B, H_q, C, T]`` in the query's dtype (written chunk by chunk into one
  tensor: the one full-size buffer; transformers' kernel holds three or four);
* ``"sum"``: each key's weights summed over the queries, ``[B, H_q, 1, T]`` float32 (all a method that
  accumulates attention, H2O's heavy hitters, reads: no ``C x T`` buffer at all).

A pass that fits the budget whole runs transformers' kernel unchanged (the same bits as before).
The budget follows the sweep's ``resources.worker_memory_gb`` (:func:`set_worker_memory`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

#: the share of a worker's memory one layer's attention buffers may take (the model, its KV cache and
#: the other activations have the rest)
ATTENTION_SHARE = 1 / 8
DEFAULT_WORKER_MEMORY_GB = 8.0
_budget = int(DEFAULT_WORKER_MEMORY_GB * 2**30 * ATTENTION_SHARE)

Rows = Literal["all", "sum"]


def set_worker_memory(gb: float) -> None:
    """Plan attention buffers for a worker of ``gb`` GiB (``resources.worker_memory_gb``)."""
    global _budget
    if not gb > 0:
        raise ValueError(f"worker memory must be positive, got {gb}")
    _budget = int(gb * 2**30 * ATTENTION_SHARE)


def budget_bytes() -> int:
    """The most bytes one layer's eager attention buffers may take."""
    return _budget


def chunk_queries(batch: int, heads: int, keys: int, dtype: torch.dtype, budget: int | None = None) -> int:
    """How many queries' buffers fit ``budget``: per query, a score row in the query's dtype, the mask
    added (another), the float32 softmax and its cast back (``2 x 3`` bytes of the dtype + 4 per key)."""
    per_query = batch * heads * keys * (3 * dtype.itemsize + 4)
    return max(1, (budget_bytes() if budget is None else budget) // per_query)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    # transformers' repeat_kv: each KV head's keys shared by its group of query heads
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    rows: Rows = "all",
    budget: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Transformers' eager attention (``[B, C, H_q, d]`` output) over query chunks that fit ``budget``
    (default :func:`budget_bytes`); the weights as ``rows`` asks (module docstring)."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    b, h_q, c, _ = query.shape
    t = key.shape[-2]
    size = chunk_queries(b, h_q, t, query.dtype, budget)
    if size >= c:
        out, weights = eager_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
        return out, (weights.float().sum(dim=-2, keepdim=True) if rows == "sum" else weights)
    groups = h_q // key.shape[1]  # the module's num_key_value_groups: query heads per KV head
    keys = _repeat_kv(key, groups).transpose(2, 3)
    values = _repeat_kv(value, groups)
    out = query.new_empty(b, h_q, c, values.shape[-1])
    kept = query.new_empty(b, h_q, c, t) if rows == "all" else None
    summed = torch.zeros(b, h_q, 1, t, dtype=torch.float32, device=query.device) if rows == "sum" else None
    for start in range(0, c, size):
        part = slice(start, min(c, start + size))
        w = torch.matmul(query[:, :, part], keys) * scaling
        if attention_mask is not None:
            w = w + attention_mask[:, :, part]
        w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
        w = nn.functional.dropout(w, p=dropout, training=module.training)
        out[:, :, part] = torch.matmul(w, values)
        if kept is not None:
            kept[:, :, part] = w
        if summed is not None:
            summed += w.float().sum(dim=-2, keepdim=True)
    return out.transpose(1, 2).contiguous(), (kept if rows == "all" else summed)
