from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvleague.engine.contract import CacheView, EvictionMethod, Needs, SequenceInfo
from kvleague.methods.kernels import ObservesTogether, check_window_kernel, layer_mean_row, newest_on_host
from kvleague.methods.registry import register_method


def standardise(x: torch.Tensor) -> torch.Tensor:
    """(x - mean) / (std + 1e-8), sample std (ddof = 1), as the authors' per-term standardisation."""
    return (x - x.mean()) / (x.std() + 1e-8)


def global_redundancy(keys: list[torch.Tensor]) -> torch.Tensor:
    """``[T]``: per layer and KV head, softmax over slots of the mean cosine similarity of each key to
    the cached keys, (k̂_i . sum_j k̂_j - 1) / T with k̂ = k / (||k|| + 1e-8); mean over heads, then layers."""
    per_layer = []
    for k in keys:
        unit = k[None].float()
        unit = unit / (unit.norm(dim=-1, keepdim=True) + 1e-8)
        similarity = ((unit * unit.sum(dim=2, keepdim=True)).sum(dim=-1) - 1.0) / unit.shape[2]
        per_layer.append(F.softmax(similarity, dim=-1).mean(dim=(0, 1)))
    return torch.stack(per_layer).mean(dim=0)


@register_method("rkv_authors")
@dataclass
class RKVAuthors(ObservesTogether, EvictionMethod):
    """R-KV as the EpiKV authors' harness runs it (their ``RKVEviction``): one global score, standardised terms.

    After every decode forward the method records a = mean over layers of the newest query's attention
    row (mean over query heads), keyed by absolute position (0 for positions that entered later); it
    keeps the last ``window`` (8) such rows. At an eviction:

    * importance = mean over the recorded rows of their max-pool along the cache slots (kernel
      ``kernel`` = 7, stride 1, padding 3, padding never wins the max);
    * redundancy = :func:`global_redundancy` (per head softmax of the mean cosine similarity, averaged
      over heads and layers);
    * score = ``lam`` · z(importance) − (1 − ``lam``) · z(redundancy), z = standardised over the slots
      (sample std, + 1e-8), ``lam`` = 0.1; the newest ``window`` slots +inf. One ``[T]`` score, prompt
      evictable.

    When it fires: the authors compress when the cache reaches B + 128 entries (``seq_len >= B +
    buffer``), back to B. kvleague's engine evicts when the cache exceeds B + N, so the authors' cadence
    is ``cadence: buffer=127``. Run it with ``protocol: {positions: compact, cadence: buffer=127}``;
    kept positions and greedy tokens then equal the authors' class (float32 eager; docs/methods.md).

    Deviations: equal scores keep the more recent position (theirs: ``topk``'s choice); a prompt
    longer than B is compressed right after prefill with the last prompt query's row as the only
    observation (theirs waits until the cache reaches B + 128 during decoding).

    The original R-KV (per layer and KV head, importance from the window's queries, raw mix) is ``rkv``.

    Paper: Cai et al., arXiv 2505.24133 (R-KV), as adapted in stevenkolawole/epiphany-kv-cache
    ``src/eviction.py`` ``RKVEviction`` (``scripts/benchmark.py`` method ``r_kv``).
    """

    needs = Needs(attention=True, eager=True)

    lam: float = 0.1
    window: int = 8
    kernel: int = 7

    def __post_init__(self) -> None:
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")
        check_window_kernel(self.window, self.kernel)

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.rows: deque[torch.Tensor] = deque(maxlen=self.window)  # decode rows, dense by absolute position
        self.fed_row: torch.Tensor | None = None  # the last fed token's row, until the next decode step

    @classmethod
    def observe_together(cls, methods, observations) -> None:
        """Each sequence's row (:func:`layer_mean_row`, the model's dtype, then float32) with its cached
        positions, sequences of equal lengths in one reduction and one copy to the host."""

        def row(rows: torch.Tensor, i: int) -> list[torch.Tensor]:
            return [layer_mean_row(rows, methods[i].info.dtype).float()]

        for members, _, cached, (attention,) in newest_on_host(observations, [m.info.dtype for m in methods], row):
            for j, i in enumerate(members):
                methods[i]._record(
                    observations[i].phase, torch.from_numpy(cached[j]), torch.from_numpy(attention[j]).float()
                )

    def _record(self, phase: str, positions: torch.Tensor, row: torch.Tensor) -> None:
        dense = torch.zeros(int(positions.max()) + 1, dtype=torch.float32)
        dense[positions] = row
        if phase == "prefill":  # the authors' class never sees a prefill: used only to compress it
            self.fed_row = dense
        else:
            self.fed_row = None
            self.rows.append(dense)

    def score(self, cache: CacheView) -> torch.Tensor:
        positions = cache.token_positions.cpu()
        length = positions.shape[0]
        rows = list(self.rows) + ([self.fed_row] if self.fed_row is not None else [])
        observed = torch.zeros(len(rows), length)
        for j, dense in enumerate(rows):
            seen = positions < dense.shape[0]
            observed[j, seen] = dense[positions[seen]]
        pooled = F.max_pool1d(
            observed.unsqueeze(1), kernel_size=self.kernel, stride=1, padding=self.kernel // 2
        ).squeeze(1)
        importance = pooled.mean(dim=0)
        redundancy = global_redundancy([k.cpu() for k in cache.keys])
        scores = self.lam * standardise(importance) - (1.0 - self.lam) * standardise(redundancy)
        scores[-self.window :] = float("inf")
        return scores
