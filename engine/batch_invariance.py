"""A row's numbers do not depend on the batch it decodes in (on the CPU).

Re-running a cell must store the same bits, whatever other cells share its batch. Two CPU kernels
made a row's float rounding depend on its companions (measured on MKL, AVX2, float32 and float64):

* **GEMM row count.** A linear layer over ``M`` rows rounds each row by a kernel chosen from ``M``:
  rows fall in three classes, ``M = 1`` (a matrix-vector product), ``2-3`` and ``>= 4`` (the same
  bits for every ``M`` from 4 to 128, at every row position). A sequence decoded alone (``M = 1``)
  and in a batch of 2 or 16 therefore got different keys; knorm, whose scores tie exactly up to
  rounding (RoPE keeps a key's norm), then kept different slots (KL moved by up to 1e-3).
  :func:`pad_linear_rows` runs every linear layer over at least :data:`MIN_ROWS` rows (zero rows
  added, their outputs dropped), so one class serves every batch size.
* **Padded attention length.** A ragged decode step attends over the batch's longest cache under a
  padding mask; SDPA's CPU kernel sums a row's softmax and values in an order set by that padded
  length, so a row's output changed with its companions' lengths. :func:`attend_by_length` runs the
  rows of each length together over exactly their slots, with no mask, as each runs alone.

Thread count is a setting: 1 and 2 threads round differently (a fixed count reproduces), so a
row records it. Not covered: accelerators (cuBLAS picks kernels by shape too), and the slab backend's ragged
steps (their captured shapes cannot follow the lengths; the default ``hf`` backend is covered). The eager kernel
(``Needs.eager``) measured row-invariant under padding (h2o, tova; tests/test_rerun_determinism.py
covers knorm).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn

from kvleague.engine.to_device import to_device

#: the fewest rows a CPU linear layer computes: every row count from here up rounds alike (see above)
MIN_ROWS = 4


def _padded_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows >= MIN_ROWS or rows == 0:
        return nn.functional.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])])
    return nn.functional.linear(padded, self.weight, self.bias)[:rows].reshape(*x.shape[:-1], -1)


def pad_linear_rows(model: nn.Module) -> None:
    """Every ``nn.Linear`` of ``model`` computes at least :data:`MIN_ROWS` rows (CPU models only: a
    GPU's kernels are not made row-invariant by this)."""
    for module in model.modules():
        if type(module) is nn.Linear:  # not subclasses (quantized layers have their own forward)
            module.forward = types.MethodType(_padded_forward, module)


def attend_by_length(
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: list[int],
) -> torch.Tensor:
    """``[N, 1, H_q, d]``: ``kernel(query, key, value)`` (one query per row, no mask) over each row's
    first ``lengths[i]`` slots, the rows of one length in one call, as a batch of equal rows would."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    if len(groups) == 1:
        n = lengths[0]
        return kernel(query, key[:, :, :n], value[:, :, :n])[0]
    out = None
    for n, rows in groups.items():
        index = to_device(rows, query.device)
        part = kernel(
            query.index_select(0, index), key[:, :, :n].index_select(0, index), value[:, :, :n].index_select(0, index)
        )[0]
        if out is None:
            out = part.new_empty((len(lengths), *part.shape[1:]))
        out.index_copy_(0, index, part)
    assert out is not None
    return out


def visible_prefix(attention_mask: torch.Tensor) -> list[int] | None:
    """Per row, how many slots a one-query step's mask (``[N, 1, 1, T]``, boolean or additive) shows,
    where each row sees a prefix of its slots (a ragged batch's packed rows); None where a row sees
    anything else (a sliding window's suffix): such a step keeps its mask."""
    last = attention_mask[:, 0, -1]
    visible = last if last.dtype == torch.bool else last == 0
    lengths = visible.sum(dim=-1)
    if not torch.equal(visible, torch.arange(visible.shape[-1], device=visible.device) < lengths[:, None]):
        return None
    return lengths.tolist()
