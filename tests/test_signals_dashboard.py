"""The Signals page under Streamlit's AppTest, on a database holding only signal studies stored through
``runner.signals.store``; the expected figures are computed here from the stored report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest

from kvleague.analysis.paper import PUBLISHED_LAYER_RHO

APP = str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py")
N_LAYERS = 32
ENV = {
    "spec_hash": "e" * 64,
    "hostname": "h",
    "platform": "p",
    "python_version": "3",
    "torch_version": "t",
    "transformers_version": "tf",
    "cuda_version": "none",
    "gpu_name": "none",
    "gpu_count": 0,
    "kvleague_version": "0",
    "ray_version": "r",
    "git_commit": "c" * 40,
    "git_dirty": False,
}


def report(run_id: str, task: str, domain: str, rho_of_layer, created: str, n: int = 30, partial_of_layer=None) -> dict:
    """A stored report; with ``partial_of_layer``, the per-layer rows also carry the partial rho given position
    (without it, a run as written before the partial rho existed)."""
    correlations = []
    for layer in range(N_LAYERS):
        rho = rho_of_layer(layer)
        correlations.append(
            {
                "label": "occlusion_nll",
                "signal": f"hs_l2_diff_rolling64_l{layer}",
                "rho": rho,
                "lo": rho - 0.05,
                "hi": rho + 0.05,
                "p_value": 0.01,
                "n_samples": n,
                "n_pairs": 100 * n,
            }
        )
        if partial_of_layer is not None:
            partial = partial_of_layer(layer)
            correlations[-1].update(
                control="position",
                partial_rho=partial,
                partial_lo=partial - 0.05,
                partial_hi=partial + 0.05,
                partial_p_value=0.01,
            )
    correlations += [
        {
            "label": "occlusion_nll",
            "signal": "method:snapkv",
            "rho": 0.2,
            "lo": 0.1,
            "hi": 0.3,
            "p_value": 0.01,
            "n_samples": n,
            "n_pairs": 100 * n,
        },
        {
            "label": "occlusion_nll",
            "signal": "method:epikv",
            "rho": float("nan"),
            "lo": float("nan"),
            "hi": float("nan"),
            "p_value": float("nan"),
            "n_samples": n,
            "n_pairs": 100 * n,
        },
        {
            "label": "occlusion_nll",
            "signal": "h2o_mean",
            "rho": -0.1,
            "lo": -0.2,
            "hi": 0.0,
            "p_value": 0.05,
            "n_samples": n,
            "n_pairs": 100 * n,
        },
    ]
    config = {"model": "tiny", "task": task, "domain": domain, "n_layers": N_LAYERS}
    return {"run_id": run_id, "created_at": created, "config": config, "environment": ENV, "correlations": correlations}


def paper_like(layer: int) -> float:
    """+0.2 in layers 7-13, -0.2 in 18-25, 0 elsewhere."""
    return 0.2 if 7 <= layer <= 13 else -0.2 if 18 <= layer <= 25 else 0.0


@pytest.fixture()
def signals_db(tmp_path, monkeypatch):
    from kvleague.runner.signals.store import store_correlations

    url = f"sqlite:///{tmp_path / 'signals.db'}"
    store_correlations(report("old", "math500", "math", lambda layer: -0.5, "2026-01-01T00:00:00+00:00"), url)
    store_correlations(
        report(
            "new",
            "math500",
            "math",
            paper_like,
            "2026-02-01T00:00:00+00:00",
            partial_of_layer=lambda layer: -paper_like(layer),
        ),
        url,
    )
    store_correlations(report("code", "humaneval", "code", lambda layer: 0.0, "2026-02-01T00:00:00+00:00", n=12), url)
    monkeypatch.setenv("KVLEAGUE_DB", url)
    return url


def test_signals_page_shows_the_latest_runs_bands_and_methods(signals_db):
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["page"] = "signals"
    at.run()
    assert not at.exception, at.exception
    assert at.title[0].value == "Signals"
    assert len(at.dataframe) == 4  # bands, every layer, methods, all-layer signals
    verdicts = at.dataframe[0].value
    # with position held fixed the math run's pattern is reversed; the code run has no partial rho (stored before it)
    assert sorted(zip(verdicts["task"], verdicts["rho"])) == [
        ("humaneval", "raw"),
        ("math500", "position held fixed"),
        ("math500", "raw"),
    ]
    partial = verdicts[verdicts["rho"] == "position held fixed"].iloc[0]
    assert partial["verdict"] == "does not hold as stated: early band negative, late band positive"
    bands = verdicts[verdicts["rho"] == "raw"].set_index("task")
    math = bands.loc["math500"]  # the newer run only: the old one (all -0.5) is superseded
    early = [layer for layer in range(N_LAYERS) if 7 / 32 <= layer / 32 <= 13 / 32]
    late = [layer for layer in range(N_LAYERS) if 18 / 32 <= layer / 32 <= 25 / 32]
    assert (math["early band: layers > 0"], math["early band: layers"]) == (len(early), 7)
    assert (math["late band: layers < 0"], math["late band: layers"]) == (len(late), 8)
    assert math["mean rho early"] == pytest.approx(np.mean([paper_like(layer) for layer in early]))
    assert math["verdict"].startswith("holds")
    code = bands.loc["humaneval"]  # rho 0 +- 0.05 everywhere: no layer's interval excludes 0
    assert (code["early band: layers > 0"], code["late band: layers < 0"], code["samples"]) == (0, 0, 12)
    assert code["verdict"].startswith("not resolved")
    depth = at.dataframe[1].value
    assert len(depth) == 2 * N_LAYERS and set(depth[depth["task"] == "math500"]["rho"]) == {0.2, -0.2, 0.0}
    row = depth[(depth["task"] == "math500") & (depth["layer"] == 10)].iloc[0]
    assert row["depth"] == pytest.approx(10 / 32) and row["band"] == "positive"
    methods = at.dataframe[2].value
    snap = methods[(methods["method"] == "snapkv") & (methods["task"] == "math500")].iloc[0]
    assert (snap["rho"], snap["rho_lo"], snap["rho_hi"]) == (0.2, 0.1, 0.3)
    assert methods[methods["method"] == "epikv"]["rho"].isna().all()  # NaN stored as null, shown empty
    charts = at.get("vega_lite_chart")
    assert len(charts) == 1
    frames = [pa.ipc.open_stream(d.data.data).read_pandas() for d in charts[0].proto.datasets]
    bands = next(f for f in frames if "band" in f.columns and "from" in f.columns)
    assert sorted(zip(bands["from"], bands["to"])) == [(7 / 32, 13 / 32), (18 / 32, 25 / 32)]
    reference = next(f for f in frames if "dataset" in f.columns).sort_values("layer")
    assert set(reference["dataset"]) == {"math500"}  # the default reference series
    assert reference["rho"].tolist() == list(PUBLISHED_LAYER_RHO["math500"][2])
    ours = next(f for f in frames if "rho_lo" in f.columns)
    math_rows = ours[ours["task"] == "math500"].sort_values("layer")
    assert list(zip(math_rows["layer"], math_rows["rho"])) == [(layer, paper_like(layer)) for layer in range(N_LAYERS)]

    at.radio(key="sig_kind").set_value("position held fixed").run()  # the chart and the layer table, partial rho
    assert not at.exception, at.exception
    depth = at.dataframe[1].value
    assert set(depth["task"]) == {"math500"}  # the code run has none
    assert depth.sort_values("layer")["rho"].tolist() == [-paper_like(layer) for layer in range(N_LAYERS)]


def test_rows_stored_before_the_partial_rho_still_load(tmp_path):
    """A database at revision 0006 (no partial columns) reads, and after the upgrade its rows have no partial rho."""
    from kvleague.analysis.signal_tables import markdown, read_correlations
    from kvleague.db.session import get_engine, upgrade
    from kvleague.runner.signals.store import store_correlations

    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = get_engine(url)
    upgrade(engine, "0006")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO signal_correlations (row_key, run_id, model, task, domain, label, signal, family, layer, n_layers,"
            " rho, rho_lo, rho_hi, p_value, n_samples, n_pairs, created_at) VALUES ('k', 'old', 'tiny', 'math500', 'math',"
            " 'occlusion_nll', 'hs_l2_diff_rolling64_l9', 'hs_l2_diff_rolling64', 9, 32, 0.3, 0.2, 0.4, 0.01, 30, 3000,"
            " '2026-01-01 00:00:00')"
        )
    before = read_correlations(engine)
    assert before["rho"].tolist() == [0.3] and before["partial_rho"].isna().all()
    store_correlations(
        report("new", "humaneval", "code", paper_like, "2026-02-01T00:00:00+00:00", partial_of_layer=lambda layer: 0.0),
        url,
    )  # upgrades to head on the way
    after = read_correlations(get_engine(url))
    old = after[after["run_id"] == "old"].iloc[0]
    assert old["rho"] == 0.3 and pd.isna(old["partial_rho"]) and old["control"] is None
    new = after[(after["run_id"] == "new") & (after["layer"] == 9)].iloc[0]
    assert (new["control"], new["partial_rho"], new["partial_hi"]) == ("position", 0.0, 0.05)
    text = markdown(after)
    assert "partial rho with the token's position held fixed of hs_l2_diff_rolling64" in text
    assert (
        "| 9 | 0.28 | positive | +0.300 [+0.200, +0.400] | +0.200 [+0.150, +0.250] |" in text
    )  # math (raw only), code


def test_reference_series_are_the_authors_csv_figures():
    """Spot checks against the issue's quotation of the paper (MATH-500: +0.112 at layer 10, -0.209 at 21)."""
    from kvleague.analysis.signal_tables import reference_series

    ref = reference_series()
    math = ref[ref["dataset"] == "math500"].set_index("layer")["rho"]
    assert round(math[10], 3) == 0.112 and round(math[21], 3) == -0.209
    assert all(len(values) == 32 for _, _, values in PUBLISHED_LAYER_RHO.values())


def test_signals_page_on_a_database_without_studies(tmp_path, monkeypatch):
    from kvleague.db.session import get_engine, upgrade

    url = f"sqlite:///{tmp_path / 'empty.db'}"
    upgrade(get_engine(url))
    monkeypatch.setenv("KVLEAGUE_DB", url)
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["page"] = "signals"
    at.run()
    assert not at.exception, at.exception
    assert "No signal studies stored yet" in at.info[0].value


def test_the_two_settings_of_the_windows_stay_apart_and_compare_side_by_side(tmp_path):
    """A run with windows over the trace is stored beside the context run of the same task (the latest of each
    setting is read, not the latest of the task); the comparison says per signal whether the two intervals are
    on the same side of 0 and overlap, and ranks the signals' rhos across settings."""
    from kvleague.analysis.signal_tables import (
        comparison_markdown,
        markdown,
        read_correlations,
        setting_agreement,
        setting_comparison,
    )
    from kvleague.runner.signals.store import store_correlations

    url = f"sqlite:///{tmp_path / 'settings.db'}"
    context = report("ctx", "math500", "math", lambda layer: 0.1 * (layer % 3) - 0.1, "2026-02-01T00:00:00+00:00")
    trace = report("trc", "math500", "math", lambda layer: 0.3 * ((layer % 3) - 1), "2026-03-01T00:00:00+00:00", n=20)
    trace["config"]["options"] = {"occluded": "trace", "trace": "self"}
    trace["correlations"][-3].update(rho=-0.2, lo=-0.3, hi=-0.1)  # snapkv: +0.2 [+0.1, +0.3] over the context
    trace["correlations"][-1].update(rho=-0.4, lo=-0.5, hi=-0.3)  # h2o_mean: -0.1 [-0.2, 0.0] over the context
    store_correlations(context, url)
    store_correlations(trace, url)
    from kvleague.db.session import get_engine

    df = read_correlations(get_engine(url))
    assert sorted(df.groupby("occluded")["run_id"].first().items()) == [("context", "ctx"), ("trace", "trc")]
    comp = setting_comparison(df).set_index("signal")
    assert comp.loc["method:snapkv", "sign"] == "opposite" and not comp.loc["method:snapkv", "overlap"]
    assert comp.loc["h2o_mean", "sign"] == "one covers 0" and not comp.loc["h2o_mean", "overlap"]
    layer0, layer1 = comp.loc["hs_l2_diff_rolling64_l0"], comp.loc["hs_l2_diff_rolling64_l1"]
    assert (layer0["rho_context"], layer0["rho_trace"], layer0["sign"], layer0["overlap"]) == (
        -0.1,
        -0.3,
        "same",
        False,
    )
    assert (layer1["sign"], layer1["overlap"]) == ("both cover 0", True)  # 0.0 [-0.05, +0.05] in both
    agree = setting_agreement(df).set_index("signals")
    per_layer = agree.loc["hs_l2_diff_rolling64 per layer"]
    assert (per_layer["n context"], per_layer["n trace"], per_layer["compared"]) == (30, 20, 32)
    assert per_layer["rank rho of the rhos"] == pytest.approx(1.0)  # the same ranking of the layers
    assert "method:epikv" not in comp.index  # no rho in either setting: not compared
    text = comparison_markdown(df)
    (line,) = [x for x in text.splitlines() if x.startswith("| method:snapkv")]
    assert [c.strip() for c in line.strip("|").split("|")] == [
        "method:snapkv",
        "+0.200 [+0.100, +0.300]",
        "-0.200 [-0.300, -0.100]",
        "opposite, apart",
    ]
    assert "math500 context (n=30)" in text and "math500 trace (n=20)" in text
    alone = markdown(df[df["occluded"] == "context"])  # one setting's tables, as before the trace setting
    assert "+0.200 [+0.100, +0.300]" in alone and "-0.200 [-0.300, -0.100]" not in alone


def test_the_report_renders_each_setting_of_the_windows_apart(tmp_path):
    """``kvleague report``'s signal section: one block of tables and one finding per task for each setting
    of the windows (never pooled), then the two side by side."""
    from types import SimpleNamespace

    from kvleague.analysis import report as report_module
    from kvleague.db.session import get_engine
    from kvleague.runner.signals.store import store_correlations

    url = f"sqlite:///{tmp_path / 'settings.db'}"
    store_correlations(report("ctx", "math500", "math", paper_like, "2026-02-01T00:00:00+00:00"), url)
    trace = report("trc", "math500", "math", lambda layer: -paper_like(layer), "2026-03-01T00:00:00+00:00", n=20)
    trace["config"]["options"] = {"occluded": "trace"}
    store_correlations(trace, url)
    lines: list[str] = []
    w = SimpleNamespace(engine=get_engine(url), findings=[], add=lambda *x: lines.extend(x))
    report_module._signals(w)
    text = "\n".join(lines)
    context_at = text.index("### Signal studies with windows over the context")
    trace_at = text.index("### Signal studies with windows over the model's own trace")
    side_at = text.index("### Signal studies: the two settings of the windows side by side")
    assert context_at < trace_at < side_at
    assert "| 7 | 0.22 | positive | +0.200 [+0.150, +0.250] |" in text[context_at:trace_at]
    assert "| 7 | 0.22 | positive | -0.200 [-0.250, -0.150] |" in text[trace_at:side_at]
    assert len(w.findings) == 2
    assert "(30 samples, tiny, windows over the context): the paper's sign pattern holds" in w.findings[0]
    assert "(20 samples, tiny, windows over the trace)" in w.findings[1] and "holds" not in w.findings[1]
