"""Attention of a slab decode step by lengths, in the KV heads as they are (``slab.py``).

A decode step's row i holds its kept slots packed in ``[0, n_i)`` of a ``[N, H_kv, capacity, d]``
slab (its new token at ``n_i - 1``), so what it may see is a length, not a mask. Where one length
serves the batch and the host knows it (an eager step), SDPA reads exactly those slots with
``enable_gqa`` and no mask (its flash kernel on a GPU). Otherwise (a ragged batch, a captured step,
whose shapes cannot follow the length) the query heads of each KV head are folded into the query
length (``[N, H_kv, group, d]``: one new token, so no causal order among them) and SDPA attends
over the whole slab under a ``[N, 1, 1, capacity]`` validity mask: each KV head is read once, not
repeated per query head (SDPA's ``enable_gqa`` with a mask falls back to its math kernel on CUDA).
Methods that read attention rows get them from the same lengths (the recorders cut each row at
``n_i``). The eager kernel (methods that declare ``Needs.eager``) keeps transformers' steps and its
4D mask; with ``grouped_eager`` (the slab backend's default on CUDA, :func:`attend_eager`) it folds
the query heads into the query length too, so each KV head is read once rather than repeated per
query head, where ``hf``'s kernel (and the CPU's default) repeats them: its matmuls' shapes differ,
so its float bits do too (~1e-16 in float64).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Lengths:
    """Each row's visible slots in a decode step: ``valid`` ``[N]`` on the device, and ``one``, the
    length every row has where the host knows one serves the batch (None inside a captured step)."""

    valid: torch.Tensor | None
    one: int | None = None
    #: eager attention in the KV heads as they are (:func:`attend_eager`), not repeated per query head
    grouped_eager: bool = False


_ACTIVE: contextvars.ContextVar[Lengths | None] = contextvars.ContextVar("kvleague_slab_lengths", default=None)


def active() -> Lengths | None:
    """The lengths of the slab decode step running now (None: attention follows its mask)."""
    return _ACTIVE.get()


@contextmanager
def decoding(lengths: Lengths) -> Iterator[None]:
    token = _ACTIVE.set(lengths)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, lengths: Lengths):
    """``[N, 1, H_q, d]`` (transformers' layout after attention) for one query per row ``[N, H_q, 1, d]``
    over the slabs ``key`` / ``value`` ``[N, H_kv, capacity, d]``."""
    n, h_q, _, d = query.shape
    h_kv = key.shape[1]
    if lengths.one is not None:
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key.narrow(-2, 0, lengths.one),
            value.narrow(-2, 0, lengths.one),
            scale=scaling,
            enable_gqa=h_q != h_kv,
        )
        return out.transpose(1, 2)
    assert lengths.valid is not None  # None only where one length serves the batch (returned above)
    slots = torch.arange(key.shape[-2], device=key.device)
    visible = (slots < lengths.valid[:, None])[:, None, None, :]  # [N, 1, 1, capacity]
    # query head j belongs to KV head j // group (transformers' repeat_kv): fold each group into queries
    grouped = query.reshape(n, h_kv, h_q // h_kv, d)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=visible, scale=scaling)
    return out.reshape(n, h_q, 1, d).transpose(1, 2)


def attend_eager(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float, lengths
) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformers' eager steps (scores scaled, the additive ``mask`` ``[N, 1, 1, capacity]`` added,
    softmax in float32 cast back, weights x values) for one query per row ``[N, H_q, 1, d]``, with each
    group of query heads folded into the query length of its KV head: K and V read once per KV head.
    Returns the output ``[N, 1, H_q, d]`` and the weights ``[N, H_q, 1, T]`` (``T``: the one length
    where the host knows it, else the capacity), as transformers' kernel returns them."""
    n, h_q, _, d = query.shape
    h_kv = key.shape[1]
    if lengths.one is not None:
        key, value = key.narrow(-2, 0, lengths.one), value.narrow(-2, 0, lengths.one)
    grouped = query.reshape(n, h_kv, h_q // h_kv, d)
    weights = torch.matmul(grouped, key.transpose(2, 3)) * scaling  # [N, H_kv, group, T]
    if mask is not None:
        weights = weights + mask[..., : key.shape[-2]]
    weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value)  # [N, H_kv, group, d]
    return out.reshape(n, h_q, 1, d).transpose(1, 2).contiguous(), weights.reshape(n, h_q, 1, -1)
