from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvleague.engine.contract import CacheView, EvictionMethod, Needs, Observation, SequenceInfo, stacked_layers
from kvleague.engine.deferred_reads import post_floats
from kvleague.methods.kernels import PositionTable
from kvleague.methods.registry import register_method


@dataclass
class RollingVariance(EvictionMethod):
    """Shared rule of ``kv_val`` and ``kv_key`` (not registered itself): a rolling mean of K or V variance.

    For each generated token t: v_t = mean over layers of (mean over KV heads of the sample variance,
    ddof = 1, over head_dim of its cached key or value), each layer's value a Python float and the
    layer mean a Python sum in layer order; score_t = mean of the last ``window`` (64) v's of the
    generated tokens up to and including t (Python sum; the series holds every generated token, also
    evicted ones), rounded to float32 and frozen. Prompt tokens are not scored (+inf: kept, as the
    authors' class keeps them). One ``[T]`` score; higher variance = keep.

    As the authors' ``KVValVarianceEviction`` / ``KVKeyVarianceEviction`` (stevenkolawole/epiphany-kv-cache
    ``src/eviction.py``; ``benchmark.py`` methods ``kv_val`` / ``kv_key``; the paper's "KV-val" and
    "KV-key" rows) under their harness, which is ``protocol: epikv_paper`` here (prompt kept, recent
    min(128, B // 4), every step, compact positions). Deviation: equal scores keep the more recent
    position (theirs: ``topk``'s choice).

    Paper: Kolawole & Smith, arXiv 2606.26472 (KV-signal baselines).
    """

    needs = Needs(new_keys_values=True, order_free_scores=True)  # frozen by position; the authors' cache in order
    #: "keys" or "values": which cached tensor the variance is taken of
    tensor: ClassVar[str] = ""

    window: int = 64

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.series: deque[float] = deque(maxlen=self.window)
        self.table = PositionTable(fill=float("inf"))

    def observe(self, obs: Observation) -> None:
        if obs.phase != "decode":
            return
        if obs.new_positions.shape[0] == 1:  # the path of a batch's decode step, with a batch of one
            RollingVariance._observe_decode([self], [obs])
            return
        tensors = obs.new_keys if self.tensor == "keys" else obs.new_values
        assert tensors is not None, "needs.new_keys_values is declared"
        for i in range(obs.new_positions.shape[0]):
            per_layer = [x[:, i, :].var(dim=-1).mean().item() for x in tensors]
            self.series.append(sum(per_layer) / len(per_layer))
            score = torch.tensor([sum(self.series) / len(self.series)])  # float32, as the authors' tensor
            self.table.write(obs.new_positions[i : i + 1], score)

    @classmethod
    def observe_batch(cls, methods, observations) -> None:
        if cls.observe is not RollingVariance.observe or any(
            o.phase != "decode" or o.new_positions.shape[0] != 1 for o in observations
        ):
            return super().observe_batch(methods, observations)
        cls._observe_decode(methods, observations)

    @staticmethod
    def _observe_decode(methods, observations) -> None:
        """Decode steps of one token: every sequence's per-layer variances in one operation and, with the
        positions, one copy to the host; then each sequence's series and score in Python floats, as the
        loop over the new tokens of ``observe`` (each layer's float as its ``item()``)."""
        tensor = methods[0].tensor
        new = torch.stack([stacked_layers(o.new_keys if tensor == "keys" else o.new_values) for o in observations])
        per_layer = new[..., 0, :].var(dim=-1).mean(dim=-1)  # [n, L]
        positions = torch.stack([o.new_positions for o in observations]).to(per_layer.device)  # [n, 1]

        def push(host: np.ndarray) -> None:
            for method, row in zip(methods, host.tolist()):
                values, position = row[:-1], int(row[-1])
                method.series.append(sum(values) / len(values))
                # the float32 tensor observe writes
                method.table.write_one(position, float(np.float32(sum(method.series) / len(method.series))))

        # float64 holds each exactly; read with the step's tokens where the loop allows (``post_floats``)
        post_floats(torch.cat([per_layer.double(), positions.double()], dim=1), push)

    def score(self, cache: CacheView) -> torch.Tensor:
        """The frozen scores on the cache's device (no host read); ``fill`` for a token still to be frozen."""
        return self.table.read(cache.token_positions, cache.current_position)


@register_method("kv_val")
@dataclass
class KVValueVariance(RollingVariance):
    """KV-val: rolling mean (64) of the value vectors' variance over head_dim; frozen; global.

    See :class:`RollingVariance` for the exact rule and the reference."""

    tensor: ClassVar[str] = "values"


@register_method("kv_key")
@dataclass
class KVKeyVariance(RollingVariance):
    """KV-key: rolling mean (64) of the key vectors' variance over head_dim; frozen; global.

    Keys as cached (post-RoPE), as the authors' class reads them; the rest is :class:`RollingVariance`."""

    tensor: ClassVar[str] = "keys"
