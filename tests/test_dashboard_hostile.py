"""The dashboard renders what a model, a task file or an import wrote as text, never as markdown or HTML
(issue 45): an image link in a completion's extracted answer made the browser fetch it from a server of
the attacker's choosing."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest

from kvleague.db.seed import Seeder
from kvleague.db.session import get_engine

APP = str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py")
IMAGE = "![x](http://attacker/x.png)"
HTML = '<img src="http://attacker/y.png">'


def test_model_text_and_imported_names_are_not_rendered(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'hostile.db'}"
    s = Seeder(get_engine(url))
    ids = dict(
        sweep_id=s.sweep(f"sweep {IMAGE}", {"name": "x"}),
        model_id=s.model("tiny"),
        task_id=s.task("math500", "math"),
        protocol_id=s.protocol(sink=4, recent=8),
        generation_id=s.generation(0.0),
        environment_id=s.env_id,
        budget=128,
        sample_index=0,
        seed=0,
        status="ok",
        generated_tokens=3,
        evictions=0,
        evicted_tokens=0,
    )
    rows = [
        {
            **ids,
            "method_spec_id": s.method(name),
            "sample_id": "p1",
            "correct": i == 0,
            "score": float(i == 0),
            "extracted": f"{IMAGE} {HTML}",
            "completion": f"so {IMAGE} {HTML}",
        }
        for i, name in enumerate(["full", f"h2o {IMAGE}"])
    ]
    s.write(rows)
    monkeypatch.setenv("KVLEAGUE_DB", url)
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["page"] = "samples"
    at.run()
    assert not at.exception, at.exception
    rendered = [
        e.value
        for kind in ("markdown", "caption", "info", "warning", "error", "title", "subheader", "header")
        for e in getattr(at, kind)
    ] + [e.label for e in at.expander]
    assert not [r for r in rendered if IMAGE in r or "<img" in r]  # none reaches markdown unescaped
    assert any(r.startswith("**h2o \\!\\[x\\]") for r in rendered)  # the method's name shown, escaped
    texts = [e.value for e in at.text]
    assert sum(IMAGE in t and HTML in t for t in texts) == 2  # each method's extracted answer, as text
    at.sidebar.radio(key="page").set_value("Provenance").run()
    assert not at.exception, at.exception
    labels = [e.label for e in at.expander]
    assert labels and not [label for label in labels if IMAGE in label]
