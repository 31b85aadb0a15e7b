"""The lm-eval bridge both ways: kvleague as an lm-eval model, and lm-eval tasks as kvleague tasks.

lm-eval tasks need Hub datasets, unreachable here, so each test writes a local task (YAML with
``dataset_path: json`` and a JSONL file) into a tmp dir. The oracle: the targets of half the
documents are the tiny model's own completions under the same method and budget (computed directly
with the engine), the others are not, so lm-eval's exact_match must come out at exactly 0.5, with
the right documents correct.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods.registry import build_method

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = ["2+2", "the capital of France", "3 x 7", "a color of the sky"]
METHOD, PARAMS, BUDGET = "streaming_llm", {"n_sink": 2}, 12
MAX_GEN = 10


def _prompt(question: str) -> str:
    return f"Q: {question}\nA:"  # the YAML's doc_to_text, spelled out


def _direct_completion(engine, question: str) -> str:
    ids = engine.tokenizer(_prompt(question))["input_ids"]
    settings = GenerationSettings(max_new_tokens=MAX_GEN, stop=("\n",))
    return engine.generate(ids, build_method(METHOD, PARAMS), BUDGET, Protocol(), settings).completion


@pytest.fixture(scope="module")
def local_task(engines, tmp_path_factory):
    """A local lm-eval task whose docs 0 and 2 have the tiny model's own answer as target."""
    engine = engines["llama"]
    root = tmp_path_factory.mktemp("lmeval-task")
    completions = [_direct_completion(engine, q) for q in QUESTIONS]
    assert all(c for c in completions)  # non-empty, so a wrong target cannot match by accident
    rows = [
        {"question": q, "answer": c if i % 2 == 0 else "WRONG" + c}
        for i, (q, c) in enumerate(zip(QUESTIONS, completions))
    ]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (root / "kvl_echo.yaml").write_text(
        f"""task: kvl_echo
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN}
  do_sample: false
filter_list:
  - name: raw
    filter:
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
        encoding="utf-8",
    )
    return root, completions


def test_lmeval_task_through_kvleague_scores_with_lm_eval_metrics(engines, local_task):
    from kvleague.tasks.registry import build_task

    root, completions = local_task
    engine = engines["llama"]
    task = build_task("lmeval:kvl_echo", {"include_path": str(root)})
    assert task.stop == ("\n",) and task.max_new_tokens == MAX_GEN and task.metric == "exact_match,raw"
    samples = task.load()
    assert [s.prompt for s in samples] == [_prompt(q) for q in QUESTIONS]
    results = []
    for sample, expected in zip(samples, completions):
        ids = task.build_prompt(sample, engine.tokenizer)
        settings = GenerationSettings(max_new_tokens=task.max_new_tokens, stop=task.stop)
        out = engine.generate(ids, build_method(METHOD, PARAMS), BUDGET, Protocol(), settings)
        assert out.completion == expected and out.evictions > 0
        results.append(task.score(sample, out.completion))
    assert [r.correct for r in results] == [True, False, True, False]
    assert [r.details["metrics"]["exact_match,raw"] for r in results] == [1.0, 0.0, 1.0, 0.0]
    metrics = task.aggregate(results)
    assert metrics["exact_match,raw"] == 0.5 and metrics[task.metric] == 0.5 and metrics["n"] == 4


def test_lmeval_family_errors_are_one_line(tmp_path):
    from kvleague.tasks.registry import build_task

    # a task whose dataset cannot be loaded (as a Hub dataset offline): one line, naming the fix
    (tmp_path / "kvl_missing.yaml").write_text(
        f"task: kvl_missing\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'absent.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n",
        encoding="utf-8",
    )
    with pytest.raises(KvleagueError, match="lm-eval could not build it") as info:
        build_task("lmeval:kvl_missing", {"include_path": str(tmp_path)}).load()
    assert "\n" not in str(info.value) and "include_path" in str(info.value)
    with pytest.raises(KvleagueError, match="lm-eval task name"):
        build_task("lmeval:")


@pytest.mark.parametrize("batch_size", [1, 3, "auto"])
def test_kvleague_lm_runs_a_local_task_end_to_end(tiny_models, local_task, monkeypatch, batch_size):
    """lm-eval's batch size decodes that many requests together (``auto``: all four fit; 3: the
    fourth takes the row of the first to finish), each completion the one the engine gives it alone."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import kvleague.engine.batch as batch
    from kvleague.runner.lm_eval_model import KvleagueLM

    root, completions = local_task
    lm = KvleagueLM.create_from_arg_string(
        f"pretrained={tiny_models['llama']},method={METHOD},budget={BUDGET},method.n_sink={PARAMS['n_sink']},dtype=float32",
        {"device": "cpu", "batch_size": batch_size},
    )
    batches = []  # per decode loop: (its rows, the requests it decoded)

    class Loop(batch.DecodeLoop):
        def run(self):
            rows = len(self.active)
            super().run()
            batches.append((rows, len(self.sessions)))

    monkeypatch.setattr(batch, "DecodeLoop", Loop)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=["kvl_echo"],
        task_manager=TaskManager(include_path=str(root), include_defaults=False),
        log_samples=True,
    )
    assert batches == {1: [(1, 1)] * 4, 3: [(3, 4)], "auto": [(4, 4)]}[batch_size]
    assert out["results"]["kvl_echo"]["exact_match,raw"] == 0.5
    responses = [s["resps"][0][0] for s in sorted(out["samples"]["kvl_echo"], key=lambda s: s["doc_id"])]
    assert responses == completions
    assert len(lm.generations) == 4 and all(
        g["evictions"] > 0 and g["budget"] == BUDGET and g["method"] == METHOD for g in lm.generations
    )
    assert out["config"]["kvleague_budget"] == BUDGET


def test_kvleague_lm_rejects_loglikelihood_and_bad_args(engines):
    from kvleague.runner.lm_eval_model import KvleagueLM

    lm = KvleagueLM(engine=engines["llama"], method="full", budget=64)
    with pytest.raises(NotImplementedError, match="generate_until"):
        lm.loglikelihood([])
    with pytest.raises(KvleagueError, match="unknown key 'bogus'"):
        KvleagueLM(engine=engines["llama"], bogus=1)
    with pytest.raises(KvleagueError, match="method"):
        KvleagueLM(engine=engines["llama"], method="no_such_method")
    for bad in (0, "big", "-2"):
        with pytest.raises(KvleagueError, match=r"batch_size: got .*; allowed: auto, auto:K or a positive integer"):
            KvleagueLM(engine=engines["llama"], batch_size=bad)
    with pytest.raises(KvleagueError, match=r"max_batch_size: got 0; allowed: a positive integer"):
        KvleagueLM(engine=engines["llama"], batch_size="auto", max_batch_size=0)
    assert KvleagueLM(engine=engines["llama"], batch_size="auto:4").batch_size is None
    settings = lm.settings({"until": "\n\n", "max_gen_toks": 7, "do_sample": True, "temperature": 0.5, "top_p": 0.9})
    assert (settings.stop, settings.max_new_tokens, settings.temperature, settings.top_p) == (("\n\n",), 7, 0.5, 0.9)
    assert lm.settings({"temperature": 0.7}).temperature == 0.0  # lm-eval: greedy unless do_sample


def test_console_script_and_lm_eval_registration_point_at_the_model():
    """pyproject's ``kvleague-lm-eval`` resolves to the command line's ``main``, and importing the adapter
    registers ``kvleague`` with lm-eval (the name users pass as ``--model``)."""
    import importlib

    from lm_eval.api.registry import get_model

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["kvleague-lm-eval"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr)) and module == "kvleague.runner.lm_eval_cli"
    adapter = importlib.import_module("kvleague.runner.lm_eval_model")
    assert get_model("kvleague") is adapter.KvleagueLM


@pytest.mark.slow
def test_lm_eval_cli_with_kvleague_model(tiny_models, local_task, tmp_path):
    root, _ = local_task
    cmd = [
        sys.executable, "-m", "kvleague.runner.lm_eval_cli", "run", "--model", "kvleague",
        "--model_args", f"pretrained={tiny_models['llama']},method={METHOD},budget={BUDGET},method.n_sink={PARAMS['n_sink']}",
        "--tasks", "kvl_echo", "--include_path", str(root), "--output_path", str(tmp_path / "out"),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=300, env={**_env(), "PYTHONPATH": str(REPO)}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result_files = list((tmp_path / "out").rglob("results_*.json"))
    assert len(result_files) == 1
    assert json.loads(result_files[0].read_text())["results"]["kvl_echo"]["exact_match,raw"] == 0.5


def _env() -> dict:
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_cli_defaults_to_kvleagues_device_without_a_cuda_warning(caplog):
    """lm-eval's default device is cuda:0; kvleague-lm-eval passes auto unless one is named, and auto
    is no warning (a named CUDA device without CUDA still says it fell back)."""
    from kvleague.runner.lm_eval_cli import with_device
    from kvleague.runner.lm_eval_model import _device

    run = ["run", "--model", "kvleague", "--tasks", "gsm8k"]
    assert with_device(run)[-2:] == ["--device", "auto"]
    assert with_device([*run, "--device=cpu"]) == [*run, "--device=cpu"] and with_device(["ls"]) == ["ls"]
    with caplog.at_level("WARNING"):
        assert _device("auto") == "auto" and not caplog.records
        if not __import__("torch").cuda.is_available():
            assert _device("cuda:0") == "cpu" and "CUDA is not available" in caplog.text


def test_cli_without_the_hub_goes_offline_and_says_how_to_use_a_local_copy(monkeypatch, tmp_path, capsys):
    """A Hub that cannot be reached (a closed port here) makes the run offline before lm-eval starts,
    so datasets fails at once; its error (datasets' own, raised by a real load) is one line, exit 2."""
    import datasets
    import lm_eval.__main__

    from kvleague.runner import lm_eval_cli

    with pytest.raises(ConnectionError) as real:  # conftest runs the suite offline
        datasets.load_dataset("openai/gsm8k", "main", cache_dir=str(tmp_path))
    seen = {}

    def cli_evaluate():
        seen.update(argv=list(sys.argv), offline=[os.environ.get(k) for k in lm_eval_cli.OFFLINE])
        raise real.value

    for name in lm_eval_cli.OFFLINE:
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed.getsockname()[1]}")
        monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", cli_evaluate)
        assert lm_eval_cli.main(["run", "--model", "kvleague", "--tasks", "gsm8k"]) == 2
    assert seen["offline"] == ["1", "1"] and seen["argv"][-2:] == ["--device", "auto"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "openai/gsm8k" in err and "HF_DATASETS_OFFLINE=1" in err
