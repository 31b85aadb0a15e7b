from __future__ import annotations

from dataclasses import dataclass

from kvleague.methods.epikv import EpiKVFamily, depth_to_layer
from kvleague.methods.registry import register_method


def band_layers(band: tuple[float, float], n_layers: int) -> list[int]:
    """Inclusive relative-depth band -> the decoder layers it covers (each end rounded as in EpiKV)."""
    lo, hi = depth_to_layer(band[0], n_layers), depth_to_layer(band[1], n_layers)
    return list(range(lo, hi + 1))


@register_method("epikv_bands")
@dataclass
class EpiKVBands(EpiKVFamily):
    """EpiKV band-adaptive: score = 1.29 * z_A - 1.0 * z_B of the hidden-state change averaged over two bands.

    Like ``epikv`` (same d, same causal rolling z-score, frozen, one global ``[T]`` score), but the
    signal of each side is d_t averaged over a band of decoder layers instead of one layer:
    band A = layers 7..13 of 32, band B = 18..25 of 32 (inclusive), "scaled by relative depth": each end
    is the relative depth 7/32, 13/32, 18/32, 25/32 times ``n_layers``, rounded (half to even) and
    clamped, so a 28-layer model uses 6..11 and 16..22. score_t = ``weight_a`` * z_A(t) -
    ``weight_b`` * z_B(t) with 1.29 and 1.0.

    Band ends are inclusive; the band signal is the plain mean of d over the band's layers (a Python
    sum in layer order under ``arithmetic: reference``), z-scored afterwards (not the mean of per-layer
    z-scores); on small models the bands may overlap or collapse to one layer (a 4-layer model: 1..2
    and 2..3). ``layers_a`` / ``layers_b`` give the bands as explicit layer lists (the authors'
    ``band_a_layers`` / ``band_b_layers``). The signal conventions (``series``, ``last_layer``,
    ``arithmetic``) and ``value_reserve`` are ``epikv``'s.

    Reference: the authors' ``BandAdaptiveHSEviction`` (stevenkolawole/epiphany-kv-cache
    ``src/eviction.py``). Under ``protocol: epikv_paper`` with the defaults, kept positions and greedy
    tokens equal that class's (``tests/test_epikv_reference.py``; evidence in docs/methods.md).

    Paper: Kolawole & Smith, arXiv 2606.26472 (EpiKV, band-adaptive variant).
    """

    band_a: tuple[float, float] = (7 / 32, 13 / 32)
    band_b: tuple[float, float] = (18 / 32, 25 / 32)
    weight_a: float = 1.29
    weight_b: float = 1.0
    #: explicit decoder layers of band A / B (the authors' ``band_a_layers`` / ``band_b_layers``);
    #: ``None`` = the relative-depth bands above
    layers_a: list[int] | None = None
    layers_b: list[int] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("band_a", "band_b"):
            lo, hi = getattr(self, name)
            if not 0.0 <= lo <= hi <= 1.0:
                raise ValueError(f"{name} must be (lo, hi) with 0 <= lo <= hi <= 1, got {getattr(self, name)}")
        self.band_a, self.band_b = tuple(self.band_a), tuple(self.band_b)  # type: ignore[assignment]  # YAML lists
        for name in ("layers_a", "layers_b"):
            value = getattr(self, name)
            if value is not None:
                if not value or any(layer < 0 for layer in value):
                    raise ValueError(f"{name} must be a non-empty list of layers >= 0 or null, got {value}")
                setattr(self, name, list(value))

    def groups(self, n_layers: int) -> tuple[list[int], list[int]]:
        a = self.layers_a if self.layers_a is not None else band_layers(self.band_a, n_layers)
        b = self.layers_b if self.layers_b is not None else band_layers(self.band_b, n_layers)
        return a, b

    def weights(self) -> tuple[float, float]:
        return self.weight_a, self.weight_b
