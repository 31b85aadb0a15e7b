"""The paper kvleague replicates, read once from ``analysis/paper.yaml``: the method families its
claims are about, its published numbers (accuracy, speed, context) and the authors' per-layer signal
figures. The dashboard, ``kvleague report`` and the benchmarks name these here, never as literals
of their own; changing a claim is an edit of the YAML file.

Only the standard library and PyYAML: the benchmarks import it without the dashboard's stack.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import yaml


class AccuracyClaim(NamedTuple):
    """Accuracy (%) the paper reports for ``methods`` (kvleague names) on ``task`` at ``budget``."""

    task: str
    budget: int
    methods: tuple[str, ...]
    value: float
    label: str


def _load(path: Path) -> dict:
    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


_DATA = _load(Path(__file__).with_name("paper.yaml"))

#: the paper's method (its name in kvleague)
REFERENCE_METHOD: str = _DATA["reference_method"]
#: EpiKV and its variants
REFERENCE_FAMILY: tuple[str, ...] = tuple(_DATA["families"]["reference"])
#: the baselines the paper compares EpiKV with, fixed in advance
PAPER_BASELINES: tuple[str, ...] = tuple(_DATA["families"]["paper_baselines"])
#: the control every credit is checked against (keeps the most recent tokens)
RECENCY_CONTROL: str = _DATA["recency_control"]
#: the methods that score tokens by attention
ATTENTION_SCORING: tuple[str, ...] = tuple(_DATA["families"]["attention_scoring"])

ACCURACY_CLAIMS: tuple[AccuracyClaim, ...] = tuple(
    AccuracyClaim(c["task"], int(c["budget"]), tuple(c["methods"]), float(c["value"]), c["label"])
    for c in _DATA["accuracy_claims"]
)
#: decoding speed, EpiKV over full cache, best setting ("up to")
SPEEDUP_VS_FULL: float = float(_DATA["speedup_vs_full"])
#: longest feasible context, EpiKV over the attention-based methods
CONTEXT_VS_ATTENTION: float = float(_DATA["context_vs_attention"])

_SIGNALS = _DATA["signal_study"]
SOURCE_REPOSITORY: str = _SIGNALS["source_repository"]
SOURCE_COMMIT: str = _SIGNALS["source_commit"]
N_LAYERS: int = int(_SIGNALS["n_layers"])
#: the paper's bands in layers of :data:`N_LAYERS` (inclusive), and as fractions of depth
POSITIVE_LAYERS: tuple[int, int] = tuple(_SIGNALS["positive_band_layers"])
NEGATIVE_LAYERS: tuple[int, int] = tuple(_SIGNALS["negative_band_layers"])
POSITIVE_BAND: tuple[float, float] = (POSITIVE_LAYERS[0] / N_LAYERS, POSITIVE_LAYERS[1] / N_LAYERS)
NEGATIVE_BAND: tuple[float, float] = (NEGATIVE_LAYERS[0] / N_LAYERS, NEGATIVE_LAYERS[1] / N_LAYERS)
#: dataset -> (source file, n_pairs, rho of layers 0..N_LAYERS-1)
PUBLISHED_LAYER_RHO: dict[str, tuple[str, int, tuple[float, ...]]] = {
    name: (entry["source"], int(entry["n_pairs"]), tuple(float(v) for v in entry["rho"]))
    for name, entry in _SIGNALS["published_layer_rho"].items()
}


def band_text(band: tuple[int, int]) -> str:
    """``"22-41%"``: a band of layers as rounded percentages of depth."""
    return f"{round(100 * band[0] / N_LAYERS)}-{round(100 * band[1] / N_LAYERS)}%"


_VERDICTS = _DATA["verdicts"]
#: the significance level every verdict uses
VERDICT_ALPHA: float = float(_VERDICTS["alpha"])
#: a comparison's family: the same pair's comparisons across these domains (Bonferroni over their number)
FAMILY_DOMAINS: tuple[str, ...] = tuple(_VERDICTS["family_domains"])
#: measure -> equivalence margin (a share for accuracy, nats per token for KL)
MARGINS: dict[str, float] = {k: float(v) for k, v in _VERDICTS["margins"].items()}
