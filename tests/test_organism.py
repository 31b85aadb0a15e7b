"""The organism: the shipped checkpoint's held-out accuracy through the real engine, the collapse of a
recency-only cache on long dependencies, and a reproducible training script."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from runner.organism import LONG_OPTIONS, SYNTH_TASKS, OrganismConfig, TokenCodec, render_example, train, training_batch
from runner.organism_tokenizer import organism_tokenizer
from runner.protocol import Protocol
from tasks.registry import build_task

REPO = Path(__file__).resolve().parents[1]
ORGANISM = REPO / "models" / "organism"
N = 50  # held-out samples per task
needs_checkpoint = pytest.mark.skipif(not (ORGANISM / "model.safetensors").is_file(),
                                      reason="no organism checkpoint in the repository yet (issue 8)")


@pytest.fixture(scope="module")
def engine():
    from runner.engine import Engine

    torch.set_num_threads(2)
    return Engine.load(str(ORGANISM))


def _accuracy(engine, name, options, method="full", budget=None, protocol=None, n=N):
    from runner.organism import task_accuracy

    task = build_task(name, options)
    return task_accuracy(engine, task, task.load(limit=n, seed=0), method, budget, protocol)


@needs_checkpoint
def test_checkpoint_is_small_llama_with_offline_tokenizer(engine):
    weights = ORGANISM / "model.safetensors"
    assert weights.is_file() and weights.stat().st_size <= 20 * 2**20
    assert (ORGANISM / "README.md").is_file()
    cfg = engine.model.config
    assert cfg.model_type == "llama" and cfg.num_key_value_heads < cfg.num_attention_heads
    n_params = sum(p.numel() for p in engine.model.parameters())
    assert 5e5 < n_params < 1e7
    assert len(engine.tokenizer) == len(organism_tokenizer())
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in engine.eos_ids  # an answer ends with <|im_end|>, so generation stops there


def test_organism_tokenizer_round_trips_and_makes_each_fact_one_token():
    """A fact ``k=42`` is one token (an answer is a one-step lookup); longer keys or values are not
    facts; any text, non-ASCII included, decodes back exactly."""
    tok = organism_tokenizer()
    for text in ["code Z=73. the river waited by the well.", "58+17 -> k=75\nk-9 -> r=66\nQ: k",
                 "get a b", "naïve — ünïcode ✓ x=0\t{} kp=5 k=123"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    pieces = tok.convert_ids_to_tokens(tok("Z=73 k=5\na=99 kp=5 k=123", add_special_tokens=False)["input_ids"])
    assert pieces[:6] == ["Z=73", " ", "k=5", "\n", "a=99", " "]
    assert "p=5" not in pieces and "k=12" not in pieces


def test_training_text_is_what_the_task_prompts():
    """A training row starts with exactly the ids ``Task.build_prompt`` gives the engine."""
    tok = organism_tokenizer()
    codec = TokenCodec(tok)
    for name in SYNTH_TASKS:
        task = build_task(name)
        for i, sample in enumerate(task.load(limit=5)):
            ex = task._example(int(sample.sample_id))
            ids, mask = render_example(codec, ex, [])
            prompt = task.build_prompt(sample, tok)
            assert ids[: len(prompt)] == prompt
            answer = [t for t, m in zip(ids, mask) if m]
            assert tok.decode(answer) == sample.reference + "<|im_end|>"


@needs_checkpoint
@pytest.mark.parametrize("name", SYNTH_TASKS)
def test_full_cache_held_out_accuracy_at_least_90(engine, name):
    assert _accuracy(engine, name, {}) >= 0.9


@needs_checkpoint
@pytest.mark.parametrize("name", SYNTH_TASKS)
def test_streaming_llm_collapses_on_long_dependencies_while_full_does_not(engine, name):
    """Budget 64 is far below the >= 320-token dependency: sinks + recent window lose the fact."""
    protocol = Protocol(sink=4, recent=16)
    full = _accuracy(engine, name, LONG_OPTIONS, "full", n=30)
    streaming = _accuracy(engine, name, LONG_OPTIONS, "streaming_llm", 64, protocol, n=30)
    assert full >= 0.8
    assert streaming <= 0.25 * full, (full, streaming)


def _tiny(seed=0):
    return OrganismConfig(seed=seed, steps=12, batch_size=4, hidden=32, layers=2, heads=2, kv_heads=1,
                          intermediate=64, min_length=60, max_length=120, warmup=3, threads=1)


def test_training_is_reproducible_from_the_seed(tmp_path):
    a = train(_tiny(), tmp_path / "a", minutes=None, eval_samples=0, progress=False)
    b = train(_tiny(), tmp_path / "b", minutes=None, eval_samples=0, progress=False)
    c = train(_tiny(seed=1), tmp_path / "c", minutes=None, eval_samples=0, progress=False)
    assert a.completed and a.steps == 12
    assert a.losses == b.losses
    assert a.losses != c.losses
    from safetensors.torch import load_file

    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    log = json.loads((tmp_path / "a" / "training.json").read_text())
    assert log["steps_done"] == 12 and log["completed"] and len(log["losses"]) == 12


def test_data_stream_is_a_function_of_seed_and_step():
    codec = TokenCodec(organism_tokenizer())
    cfg = OrganismConfig(steps=100)
    x1, a1, _ = training_batch(cfg, 37, codec)
    x2, a2, _ = training_batch(cfg, 37, codec)
    assert torch.equal(x1, x2) and torch.equal(a1, a2)
    x3, _, _ = training_batch(OrganismConfig(steps=100, seed=5), 37, codec)
    assert x3.shape != x1.shape or not torch.equal(x3, x1)
    assert a1.sum() > 0


def test_train_organism_command_writes_checkpoint_plot_and_card(tmp_path, capsys):
    from runner import organism_commands
    from runner.cli import _Parser
    from runner.engine import Engine

    parser = _Parser(prog="kvleague")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    organism_commands.register(sub)
    out = tmp_path / "org"
    args = parser.parse_args(["train-organism", "--out", str(out), "--steps", "3", "--batch-size", "2", "--hidden", "32",
                              "--layers", "2", "--heads", "2", "--kv-heads", "1", "--intermediate", "64", "--threads", "1",
                              "--eval-samples", "0", "--no-progress"])
    assert args.func(args) == 0
    assert "3 steps completed" in capsys.readouterr().out
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "model.safetensors").is_file() and (out / "training.json").is_file()
    engine = Engine.load(str(out))  # loads through the same path as any checkpoint
    assert engine.model.config.num_hidden_layers == 2
