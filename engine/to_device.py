"""Host data copied to the device without waiting for it.

A copy to a CUDA device from pageable host memory synchronizes the stream: the host waits until
every kernel queued before it has run (PyTorch's blocking copy), so a decode step's few small
copies (its tokens and positions, an eviction's counts and row indices) would each drain the
queue. :func:`to_device` stages the data in pinned memory (PyTorch's caching host allocator, which
keeps the block until the copy is done) and copies it without blocking. Elsewhere it is the plain
``torch.tensor``.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(data: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)``, on CUDA through pinned memory, not blocking.
    ``data`` may be a tensor: one on the host (a method's scores computed there) is copied so too;
    one already on ``device`` comes back as it is (cast to ``dtype`` if given)."""
    device = torch.device(device)
    if isinstance(data, torch.Tensor):
        if device.type == "cuda" and data.device.type == "cpu":
            # a pinned snapshot: the caller may write to ``data`` before the copy has run
            staged = torch.empty(data.shape, dtype=dtype or data.dtype, pin_memory=True).copy_(data)
            return staged.to(device, non_blocking=True)
        return data.to(device=device, dtype=dtype or data.dtype)
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype).pin_memory().to(device, non_blocking=True)
