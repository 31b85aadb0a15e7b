"""What a chart must not do, checked on its Vega-Lite spec and its data rather than on pixels (the
dashboard's page tests and the browser test run it on every chart of every page):

* a line across budgets that joins points of different slices: each such line's points must carry
  the slice columns (:data:`analysis.queries.SLICE_COLUMNS`), one value of each per line;
* a legend that cannot show every series: none at all for a colour with several values (and no
  direct text labels), a ``symbolLimit`` below the number of values, a colour scale whose domain
  leaves values out, or more rows than the chart's height holds;
* a chart with no data.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pandas as pd

from kvleague.analysis.queries import SLICE_COLUMNS

#: the pixels one legend row takes, and the least plot height left beside the legend
LEGEND_ROW_PX = 18
MIN_PLOT_PX = 150
#: Streamlit's chart height when the spec gives none
DEFAULT_HEIGHT = 400
SERIES_CHANNELS = ("color", "fill", "stroke")
GROUPING_CHANNELS = ("color", "fill", "stroke", "detail", "strokeDash", "shape", "opacity")


def _layers(spec: dict[str, Any], data: Any = None, encoding: dict | None = None) -> Iterator[tuple[dict, Any, dict]]:
    """Each unit spec as ``(mark, data, encoding)``, with data and encoding inherited from its parents."""
    data = spec.get("data", data)
    encoding = {**(encoding or {}), **spec.get("encoding", {})}
    children = [c for key in ("layer", "hconcat", "vconcat", "concat") for c in spec.get(key, [])]
    if "spec" in spec:
        children.append(spec["spec"])
    if not children:
        mark = spec.get("mark")
        yield ({"type": mark} if isinstance(mark, str) else dict(mark or {}), data, encoding)
    for child in children:
        yield from _layers(child, data, encoding)


def _frame(data: Any, datasets: dict[str, pd.DataFrame]) -> pd.DataFrame:
    if isinstance(data, dict) and "name" in data:
        return datasets.get(data["name"], pd.DataFrame())
    if isinstance(data, dict) and "values" in data:
        return pd.DataFrame(data["values"])
    return pd.DataFrame()


def _fields(channel: Any) -> list[str]:
    items = channel if isinstance(channel, list) else [channel]
    return [c["field"] for c in items if isinstance(c, dict) and "field" in c]


def problems(spec: dict[str, Any], datasets: dict[str, pd.DataFrame]) -> list[str]:
    """What is wrong with a chart, one line each; empty when nothing is."""
    out: list[str] = []
    layers = [(mark, _frame(data, datasets), enc) for mark, data, enc in _layers(spec)]
    if all(frame.empty for _, frame, _ in layers):
        return ["the chart has no data"]
    height = spec.get("height", DEFAULT_HEIGHT)
    labelled = {f for mark, _, enc in layers if mark.get("type") == "text" for f in _fields(enc.get("text"))}
    legends: dict[str, tuple[set, Any, Any]] = {}
    for mark, frame, enc in layers:
        if frame.empty:
            continue
        if mark.get("type") in ("line", "trail") and "budget" in _fields(enc.get("x")):
            groups = [f for ch in GROUPING_CHANNELS for f in _fields(enc.get(ch))]
            missing = [c for c in SLICE_COLUMNS if c not in frame.columns]
            if missing:
                out.append(f"a line across budgets whose points do not say their {', '.join(missing)}")
            else:
                mixed = (
                    frame.groupby(groups, dropna=False)[list(SLICE_COLUMNS)].nunique().max()
                    if groups
                    else frame[list(SLICE_COLUMNS)].nunique()
                )
                for column, n in mixed.items():
                    if n > 1:
                        out.append(f"a line across budgets joins {n} different values of {column}")
        for ch in SERIES_CHANNELS:
            channel = enc.get(ch)
            if (
                not isinstance(channel, dict)
                or "field" not in channel
                or channel.get("type") not in ("nominal", "ordinal")
            ):
                continue
            field = channel["field"]
            values, legend, scale = legends.get(field, (set(), {}, None))
            values |= set(frame[field].dropna().unique()) if field in frame.columns else set()
            # layers share one legend per field; Vega-Lite drops it when any of them disables it
            here = channel.get("legend", {})
            legends[field] = (
                values,
                None if here is None or legend is None else here or legend,
                channel.get("scale", scale),
            )
    for field, (values, legend, scale) in legends.items():
        n = len(values)
        if n < 2:
            continue
        domain = (scale or {}).get("domain")
        if isinstance(domain, list) and not values <= set(domain):
            out.append(f"the colour scale of {field} leaves out {sorted(map(str, values - set(domain)))[:3]}")
        if legend is None:
            if field not in labelled:
                out.append(f"{n} series of {field} with neither a legend nor direct labels")
            continue
        limit = legend.get("symbolLimit")
        if limit not in (None, 0) and limit < n:
            out.append(f"the legend of {field} lists {limit} of its {n} values")
        columns = legend.get("columns") or 1
        rows = -(-n // columns)
        if legend.get("orient", "right") in ("top", "bottom"):
            if height - rows * LEGEND_ROW_PX < MIN_PLOT_PX:
                out.append(
                    f"the legend of {field} ({rows} rows) leaves the plot under {MIN_PLOT_PX}px of its height {height}"
                )
        elif rows * LEGEND_ROW_PX > height:
            out.append(
                f"the legend of {field} ({rows} rows at the side) is taller than the chart ({height}px): it is cut off"
            )
    return out


def arrow_frame(raw: bytes) -> pd.DataFrame:
    """A Streamlit chart's dataset (Arrow IPC bytes) as a DataFrame."""
    import pyarrow as pa

    return pa.ipc.open_stream(io.BytesIO(raw)).read_all().to_pandas()
