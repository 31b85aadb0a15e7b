"""A re-run cell stores the same bits (issue 46): a row's numbers do not depend on the batch it was
computed in (engine/batch_invariance.py), so a cell re-run alone (a resume), after other cells, or
in another company gives bitwise what it gave first. knorm is the sharpest probe: RoPE keeps a key's
norm, so the copies of a repeated token tie up to rounding, and any rounding difference moves the
kept slots (on main: KL by 1e-4 to 1e-3 on these samples)."""

from __future__ import annotations

import pytest
import torch

from kvleague.engine.protocol import Protocol
from kvleague.methods import build_method
from kvleague.runner import fidelity
from kvleague.runner.sweep import expand
from kvleague.runner.sweep_config import parse_config
from kvleague.runner.sweeping.cell import CellWorker
from kvleague.runner.sweeping.grid import batches
from tests.conftest import DATA_DIR

TEXT = "the cat sat on the mat and the dog sat on the log; the cat and the dog. " * 4


def _sample(ids: list[int], i: int) -> list[fidelity.Segment]:
    return [(ids[i : i + 60 + i], False), (ids[100 + i : 124 + i], True)]


def test_every_linear_row_rounds_alike_at_any_batch_size(engines):
    """The GEMM cause: a row through any linear layer of the model (its weights) gives the bits it
    gives alone, whatever rows share the call (MKL rounds by the row count's kernel: 1 / 2-3 / 4+)."""
    model = engines["llama"].model
    torch.manual_seed(0)
    for name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)][:3]:
        rows = torch.randn(9, 1, layer.in_features)
        alone = layer(rows[:1])
        for n in (2, 3, 4, 9):
            assert torch.equal(layer(rows[:n])[:1], alone), (name, n)


def test_a_knorm_sample_gives_the_same_bits_alone_and_in_any_batch(engines):
    """Both causes at once, in the kept slots and every per-token figure: knorm alone, beside other
    knorm rows (the linear's row count), and beside a full cache (a ragged batch: padded attention)."""
    engine = engines["llama"]
    ids = engine.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    samples = [_sample(ids, i) for i in range(3)]
    refs = [fidelity.full_cache_logprobs(engine, s) for s in samples]
    alone = fidelity.measure(engine, samples[0], build_method("knorm"), 24, Protocol(), 0, refs[0], per_token=True)
    for company, budgets in ((["knorm"], [18]), (["knorm", "full"], [18, 24])):
        batched = fidelity.measure_batch(
            engine,
            samples[: 1 + len(company)],
            [build_method("knorm")] + [build_method(m) for m in company],
            [24, *budgets],
            Protocol(),
            references=refs[: 1 + len(company)],
            per_token=True,
        )[0]
        assert batched.per_token == alone.per_token, company
        assert batched.generation.kept_positions == alone.generation.kept_positions, company
        assert batched.generation.evictions == alone.generation.evictions


def test_a_knorm_cell_rerun_alone_or_in_other_company_stores_the_same_row(tiny_models, tmp_path):
    """The sweep's view: a sample's fidelity cells run as one group; the knorm cell re-run alone (a
    resume where it alone is pending) and in a smaller group stores bitwise the same values."""
    if not (DATA_DIR / "gsm8k").is_dir():
        pytest.skip("no local GSM8K")
    config = {
        "name": "rerun",
        "database": f"sqlite:///{tmp_path / 'r.db'}",
        "data_dir": str(DATA_DIR),
        "models": [{"source": str(tiny_models["llama"]), "name": "tiny-llama", "dtype": "float32"}],
        "methods": ["full", "streaming_llm", "knorm"],
        "budgets": [24, 40],
        "tasks": [{"name": "gsm8k", "limit": 1, "measure": "fidelity"}],
        "protocol": {"sink": 2, "recent": 4, "protect_prompt": False},
        "fidelity": {"max_scored_tokens": 16},
    }
    cells = expand(parse_config(config)).cells
    [group] = batches(cells, "auto")  # one sample: every method and budget decodes together
    worker = CellWorker(torch_threads=1)
    first = dict(zip((c.key for c in group), worker.run_group(group)))
    knorm = [c for c in group if c.method == "knorm"]
    again = {
        "alone": [worker.run(c) for c in knorm],
        "beside streaming_llm": worker.run_group([knorm[0], group[1]])[:1] + worker.run_group([knorm[1], group[2]])[:1],
    }
    stored = ("kl_mean", "delta_nll_mean", "top1_agreement", "scored_tokens", "evictions", "evicted_tokens")
    for how, rows in again.items():
        for cell, row in zip(knorm, rows):
            was = first[cell.key]
            assert row["status"] == was["status"] == "ok"
            assert {k: row[k] for k in stored} == {k: was[k] for k in stored}, (how, cell.budget)
            assert row["details"]["fidelity"]["kl_max"] == was["details"]["fidelity"]["kl_max"]
            assert row["details"]["torch_threads"] == torch.get_num_threads()


def test_ragged_decode_attention_gives_each_row_its_bits_alone():
    """The attention cause: a decode row over its own slots, whatever the batch's longest cache
    (SDPA's CPU kernel under a padding mask sums in an order set by the padded length)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvleague.engine.batch_invariance import attend_by_length

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    torch.manual_seed(0)
    lengths = [21, 60, 21, 33]
    q, k, v = torch.randn(4, 4, 1, 16), torch.randn(4, 2, 64, 16), torch.randn(4, 2, 64, 16)

    def kernel(q_, k_, v_):
        return sdpa_attention_forward(module, q_, k_, v_, None, scaling=0.25)

    out = attend_by_length(kernel, q, k, v, lengths)
    for i, n in enumerate(lengths):
        assert torch.equal(out[i : i + 1], kernel(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n])[0]), i


def test_a_decode_step_whose_mask_is_no_prefix_keeps_its_mask():
    """Attention by length reads a row's first n slots, so it serves only masks that show each row a
    prefix (a ragged batch's packed rows); a sliding window shows a suffix, and the probe's sdpa wrapper
    then runs the masked kernel as it is: the oracle is transformers' own sdpa under the same mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kvleague.engine.probe import wrapper_name

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.scaling = True, 2, 0.25
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 64, 16), torch.randn(2, 2, 64, 16)
    slots = torch.arange(64)
    wrapper = ALL_ATTENTION_FUNCTIONS[wrapper_name("sdpa")]
    window = (slots >= 64 - 24).expand(2, 1, 1, 64)  # each row sees its last 24 slots
    out = wrapper(module, q, k, v, window, 0.0)[0]  # dropout by position, as kvpress's import-time patch takes it
    assert torch.equal(out, sdpa_attention_forward(module, q, k, v, window, scaling=0.25)[0])
    packed = (slots[None] < torch.tensor([[21], [60]]))[:, None, None]  # rows of 21 and 60 slots
    out = wrapper(module, q, k, v, packed, 0.0)[0]
    for i, n in enumerate((21, 60)):
        alone = sdpa_attention_forward(
            module, q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], None, scaling=0.25
        )
        assert torch.equal(out[i : i + 1], alone[0]), i
