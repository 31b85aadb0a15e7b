from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from kvleague.engine.contract import SequenceInfo
from kvleague.methods.epikv import EpiKV
from kvleague.methods.registry import register_method


class _RollingMean:
    """Mean of the last ``window`` values of a series, the current one included (``push`` as ``_RollingZ``)."""

    def __init__(self, window: int, reference: bool = True):
        self.values: deque[float] = deque(maxlen=window)
        self.reference = reference

    def push(self, new: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self.push_one(x) for x in new.tolist()], dtype=torch.float64)

    def push_one(self, x: float) -> float:
        self.values.append(x)
        total = sum(self.values) if self.reference else math.fsum(self.values)  # the authors' left-to-right sum
        return total / len(self.values)


@register_method("hs_variance")
@dataclass
class HSVariance(EpiKV):
    """HS-variance: score_t = mean_A(t) - mean_B(t), rolling means (64) of the hidden-state change; frozen.

    ``epikv`` without the detrending: the same d_t^l = ||h_t^l - h_{t-1}^l||_2 at layer A and layer B
    (same layer choice, series, last-layer and arithmetic conventions and defaults), but each series is
    reduced to the mean of its last ``window`` values (the current one included) instead of a z-score.
    One global ``[T]`` score; prompt unscored and kept.

    As the authors' ``HSVarianceEviction`` (stevenkolawole/epiphany-kv-cache ``src/eviction.py``;
    ``benchmark.py`` method ``hs_variance``, the paper's "HS-variance" row, which EpiKV-Flat detrends)
    under ``protocol: epikv_paper``; equal scores keep the more recent position (theirs: ``topk``'s).

    Paper: Kolawole & Smith, arXiv 2606.26472 (HS-variance ablation).
    """

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        reference = self.arithmetic == "reference"
        self.z_a, self.z_b = _RollingMean(self.window, reference), _RollingMean(self.window, reference)
