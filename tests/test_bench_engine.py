"""The engine's fast paths (slab cache layers, in-place eviction, grouped attention probe) against
plain reference computations. Timing is never asserted here; ``runner/bench/`` measures it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import repeat_kv

import kvleague.engine.cache as bc
from kvleague.engine.attention import attention_rows
from kvleague.engine.cache import BudgetedCache
from kvleague.engine.cache_layers import SlabLayer
from kvleague.engine.contract import Needs
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import build_method

L, H, D = 3, 2, 4


def _cache(length: int, reserve: int | None = None, seed: int = 0) -> tuple[BudgetedCache, list, list]:
    """A cache holding ``length`` random entries at positions 0..length-1, plus the entries by position."""
    config = LlamaConfig(
        num_hidden_layers=L, num_attention_heads=2 * H, num_key_value_heads=H, hidden_size=8 * H * D // 2
    )
    cache = BudgetedCache(config, L, H, torch.device("cpu"), reserve=reserve)
    gen = torch.Generator().manual_seed(seed)
    keys, values = [], []
    for layer in range(L):
        k, v = torch.randn(1, H, length, D, generator=gen), torch.randn(1, H, length, D, generator=gen)
        cache.cache.update(k, v, layer)
        keys.append(k[0].clone())
        values.append(v[0].clone())
    cache.track(torch.arange(length), prompt=False)
    return cache, keys, values


def _append(cache: BudgetedCache, keys: list, values: list, position: int, gen) -> None:
    for layer in range(L):
        k, v = torch.randn(1, H, 1, D, generator=gen), torch.randn(1, H, 1, D, generator=gen)
        cache.cache.update(k, v, layer)
        keys[layer] = torch.cat([keys[layer], k[0]], dim=1)
        values[layer] = torch.cat([values[layer], v[0]], dim=1)
    cache.track(torch.tensor([position]), prompt=False)


def _check_consistent(cache: BudgetedCache, keys: list, values: list, ordered: bool) -> None:
    """Every slot holds the K/V of the position the bookkeeping says it holds."""
    for layer, cached in enumerate(cache.cache.layers):
        pos = cache.positions[layer]
        assert cached.keys.shape[-2] == pos.shape[-1] == cache.length
        for h in range(H):
            torch.testing.assert_close(cached.keys[0, h], keys[layer][h, pos[h]], rtol=0, atol=0)
            torch.testing.assert_close(cached.values[0, h], values[layer][h, pos[h]], rtol=0, atol=0)
            if ordered:
                assert bool((pos[h][1:] > pos[h][:-1]).all()), "slots out of position order"


def _expected_kept(scores: torch.Tensor, positions: list, budget: int, protected_below: int) -> list[set]:
    """Per (layer, head): the kept positions a plain sort would choose (sinks first, then best scores)."""
    out = []
    for layer in range(L):
        for h in range(H):
            s = scores if scores.dim() == 1 else scores[layer] if scores.dim() == 2 else scores[layer, h]
            pos = positions[layer][h]
            ranked = sorted(range(pos.shape[0]), key=lambda i: (int(pos[i]) >= protected_below, -float(s[i])))
            out.append({int(pos[i]) for i in ranked[:budget]})
    return out


@pytest.mark.parametrize("granularity", ["token", "layer", "head"])
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("path", ["memmove", "scratch"])
def test_eviction_paths_keep_the_best_slots_with_their_entries(monkeypatch, granularity, ordered, path):
    if path == "scratch":  # the device-agnostic ordered path (what CUDA uses), forced on the CPU
        monkeypatch.setattr(bc, "_MEMMOVE_MAX", -1)
    budget, length, sink = 12, 20, 2
    cache, keys, values = _cache(length, reserve=budget + 1)
    gen = torch.Generator().manual_seed(1)
    position = length
    shape = {"token": (), "layer": (L,), "head": (L, H)}[granularity]
    for _step in range(12):  # one large eviction (prefill-like), then one slot per step
        positions = [p.clone() for p in cache.positions]
        scores = torch.randn(*shape, cache.length, generator=gen)
        expected = _expected_kept(scores, positions, budget, sink)
        dropped = cache.evict(scores, budget, Protocol(sink=sink), position - 1, ordered=ordered)
        assert dropped == len(positions[0][0]) - budget
        kept = [set(cache.positions[layer][h].tolist()) for layer in range(L) for h in range(H)]
        assert kept == expected
        _check_consistent(cache, keys, values, ordered)
        _append(cache, keys, values, position, gen)
        position += 1


def test_uniform_bookkeeping_survives_token_and_layer_evictions():
    cache, keys, values = _cache(10, reserve=9)
    cache.evict(torch.arange(10.0), 8, Protocol(), 9)
    assert cache.uniform and cache.positions[0] is cache.positions[1]
    cache.evict(torch.stack([torch.arange(8.0), -torch.arange(8.0), torch.arange(8.0)]), 6, Protocol(), 9)
    assert not cache.uniform and cache.heads_agree  # layers differ, heads within a layer agree
    with pytest.raises(Exception, match="per-token scores"):
        cache.evict(torch.arange(6.0), 5, Protocol(), 9)
    _check_consistent(cache, keys, values, ordered=True)


def test_protected_slots_win_over_a_methods_own_infinities():
    cache, _, _ = _cache(10, reserve=9)
    scores = torch.full((10,), float("inf"))
    scores[:3] = 0.0  # the protected sinks score lowest, every other slot is +inf
    cache.evict(scores, 5, Protocol(sink=3), 9)
    assert {0, 1, 2} <= set(cache.positions[0][0].tolist())


def test_slab_layer_appends_in_place_grows_and_adopts_assigned_tensors():
    layer = SlabLayer(reserve=6)
    k = torch.randn(1, H, 4, D)
    keys, _ = layer.update(k, k.clone())
    assert layer.capacity == 6 and keys.shape[-2] == 4  # grew straight to the reserve
    buffer = layer.buffers[0]
    layer.update(torch.ones(1, H, 2, D), torch.ones(1, H, 2, D))
    assert layer.buffers[0] is buffer  # fitted in place: no new allocation
    layer.update(torch.zeros(1, H, 1, D), torch.zeros(1, H, 1, D))
    assert layer.capacity >= 7 and layer.get_seq_length() == 7  # past the reserve: geometric growth
    torch.testing.assert_close(layer.keys[..., :4, :], k)
    layer.crop(3)
    assert layer.keys.shape[-2] == 3 and layer.get_seq_length() == 3
    layer.keys, layer.values = torch.zeros(1, H, 2, D), torch.zeros(1, H, 2, D)  # kvpress-style assignment
    assert layer.get_seq_length() == 2
    layer.update(torch.ones(1, H, 1, D), torch.ones(1, H, 1, D))
    assert layer.keys.shape[-2] == 3 and float(layer.keys[0, 0, 2, 0]) == 1.0


def test_compressing_a_long_prompt_gives_the_memory_back():
    cache, _, _ = _cache(200, reserve=9)
    assert cache.cache.layers[0].capacity == 200
    cache.evict(torch.arange(200.0), 8, Protocol(), 199)
    assert cache.cache.layers[0].capacity == 9
    assert cache.kv_bytes() == 8 * L * H * D * 2 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 3])
def test_grouped_attention_rows_equal_the_repeat_kv_reference(dtype, window):
    gen = torch.Generator().manual_seed(0)
    h_q, h_kv, t, d = 6, 2, 9, 8
    query = torch.randn(h_q, window, d, generator=gen).to(dtype)
    keys = torch.randn(h_kv, t, d, generator=gen).to(dtype)
    k = repeat_kv(keys[None], h_q // h_kv)[0].float()
    logits = query.float() @ k.transpose(-1, -2) * 0.3
    causal = torch.arange(t)[None, :] > torch.arange(t - window, t)[:, None]
    expected = torch.softmax(logits.masked_fill(causal, float("-inf")), dim=-1)
    torch.testing.assert_close(attention_rows(query, keys, 0.3), expected, rtol=1e-5, atol=1e-6)


# (epikv keeps slots in position order since issue 14: the authors' cache sums attention in that order)
@pytest.mark.parametrize("name", ["streaming_llm", "tova", "keydiff"])
def test_order_free_methods_keep_the_same_tokens_as_under_ordered_eviction(engines, monkeypatch, name):
    """The opt-out of slot order changes where entries sit, never which ones are kept or what is generated.

    (Only where scores never tie: a tie is broken by slot, so the kept set may then legitimately
    differ. knorm ties on every repeated token, whose keys differ by a rotation only; the cache tests
    above cover its per-head path with tie-free scores.)"""
    engine = engines["llama"]
    prompt_ids = torch.randperm(250, generator=torch.Generator().manual_seed(0))[:120].tolist()  # no repeated token
    monkeypatch.setattr(engine, "eos_ids", set())
    method = build_method(name)
    assert method.needs.ordered_slots is False
    ordered = build_method(name)
    monkeypatch.setattr(type(ordered), "needs", dataclasses.replace(method.needs, ordered_slots=True), raising=True)
    protocol = Protocol(sink=2, prefill_chunk=16)
    settings = GenerationSettings(max_new_tokens=30)
    with_order = engine.generate(prompt_ids, ordered, 24, protocol, settings)
    monkeypatch.undo()
    monkeypatch.setattr(engine, "eos_ids", set())
    free = engine.generate(prompt_ids, build_method(name), 24, protocol, settings)
    assert free.token_ids == with_order.token_ids
    assert free.kept_positions == with_order.kept_positions
    assert free.selection_seconds > 0 and free.method_seconds >= free.selection_seconds


def test_needs_default_keeps_slots_in_order():
    assert Needs().ordered_slots is True
    assert build_method("h2o").needs.ordered_slots and build_method("snapkv").needs.ordered_slots


def test_step_ops_counts_the_host_work_around_the_captured_step(tiny_models):
    """``bench.step_ops``: the captured body is left out of the count (a whole eager step dispatches
    far more ops than the loop around it), ``full`` copies nothing to the host but its tokens, and a
    method that evicts every step shows its evictions, its reads and its copies."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvleague.engine.protocol import GenerationSettings, Protocol
    from kvleague.methods import build_method
    from kvleague.runner.bench.step_ops import count
    from kvleague.runner.models import load_engine

    engine = load_engine(str(tiny_models["llama"]), backend="slab")
    engine.eos_ids = set()
    engine.backend.graphs = True
    prompt = list(range(40, 80))
    full = count(engine, "full", 1, 16, prompt, 4)
    h2o = count(engine, "h2o", 2, 16, prompt, 4)
    assert full["host_reads_per_step"] == 0 and h2o["host_reads_per_step"] > 0 and h2o["evictions"] == 5
    # every step copies its chosen tokens to the host (5 tokens over the 4 steps counted), and that
    # is all: an eviction's checks ride on that copy (engine/deferred_reads.py; h2o's host read is
    # the CPU's own, where the first dropped slot is, which the GPU's path does not make)
    assert full["to_host_per_step"] == 5 / 4 and h2o["to_host_per_step"] == 5 / 4
    assert count(engine, "h2o", 2, 16, prompt, 4, as_gpu=True)["host_reads_per_step"] == 0

    class All(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            All.n += 1
            return func(*args, **(kwargs or {}))

    engine.backend.graphs = False
    with engine.session(build_method("full"), 16, Protocol()) as session:
        session.feed(prompt)
        with All():
            session.decode(GenerationSettings(max_new_tokens=5))
    assert All.n / 4 > 3 * full["ops_per_step"]  # the eager forward alone is most of a step's ops


def test_a_slab_decode_step_reads_each_kv_head_once_and_only_the_kept_slots_where_one_length_serves(tiny_models):
    """``bench.step_ops``' K/V count against the slabs' own sizes: an eager step of one sequence reads
    exactly its kept slots and its new one, once per KV head (SDPA by length, ``enable_gqa``); a
    captured step of a batch reads each row's whole slab once per KV head under a validity mask
    (the query heads folded per KV head), never a copy repeated per query head (before: 1 + 2
    reads of the slab for 4 query / 2 KV heads)."""
    from kvleague.runner.bench.step_ops import count
    from kvleague.runner.models import load_engine

    engine = load_engine(str(tiny_models["llama"]), backend="slab")
    engine.eos_ids = set()
    config = engine.model.config
    slot_bytes = (
        config.num_hidden_layers
        * config.num_key_value_heads
        * 2
        * 4
        * (config.hidden_size // config.num_attention_heads)
    )
    prompt = list(range(40, 80))
    engine.backend.graphs = False
    alone = count(engine, "epikv", 1, 16, prompt, 4)
    assert alone["evictions"] == 5 and alone["kv_read_ratio"] == 1.0
    engine.backend.graphs = True
    batch = count(engine, "snapkv", 2, 16, prompt, 4)
    capacity = 16 + 1  # a batch's slab: B + the cadence's buffer + 1 (step_every 1: no buffer)
    assert batch["kv_read_bytes_per_step"] == 2 * capacity * slot_bytes


def test_an_order_free_eviction_on_the_slabs_moves_only_the_evicted_slots(tiny_models):
    """``bench.step_ops``' moved bytes against the evicted slots' bytes: an order-free method's eviction
    (tova) fills each hole below the budget from above it, alone and in a batch, and so writes twice
    the evicted slots' bytes (gathered, then scattered), not the whole cache (before: 64x at B = 32);
    so does one whose scores are order-free where the backend reorders, as on a GPU (snapkv, epikv, h2o);
    an ordered one (R-KV) still moves every kept slot, as a GPU does (its slot order is the contract)."""
    from kvleague.runner.bench.step_ops import count
    from kvleague.runner.models import load_engine

    engine = load_engine(str(tiny_models["llama"]), backend="slab")
    engine.eos_ids = set()
    engine.backend.graphs = True
    prompt = list(range(40, 80))
    for name in ("tova", "snapkv", "epikv", "h2o"):
        for batch in (1, 2):
            row = count(engine, name, batch, 16, prompt, 4, as_gpu=True)
            assert row["evicted_bytes_per_step"] > 0 and row["moved_ratio"] == 2.0, (name, row)
    assert count(engine, "rkv", 2, 16, prompt, 4, as_gpu=True)["moved_ratio"] == 2 * 16


def test_a_batch_of_epikv_reads_the_host_a_fixed_number_of_times_per_step(tiny_models):
    """The EpiKV family's batched decode path keeps each row's z-scores and score in Python floats and
    grows the rows' score tables after one read: a batch of 8 reads the host no more often per step
    than a batch of 2 (before, every row read its positions' maximum and its scores)."""
    from kvleague.runner.bench.step_ops import count
    from kvleague.runner.models import load_engine

    engine = load_engine(str(tiny_models["llama"]), backend="slab")
    engine.eos_ids = set()
    engine.backend.graphs = True
    prompt = list(range(40, 80))
    two, eight = (count(engine, name, n, 16, prompt, 4) for name, n in (("epikv", 2), ("epikv", 8)))
    assert two["evictions"] == eight["evictions"] == 5
    assert 0 < eight["host_reads_per_step"] <= two["host_reads_per_step"]


def test_a_batch_step_s_host_work_per_row_does_not_grow_with_the_layers(tmp_path):
    """What a batched step does per row is per row, not per row and layer: the methods' observations,
    scores and the eviction of every layer's slabs are tensors over the layers (a row's queries,
    attention rows and hidden states stacked once per step for the batch; one gather for all layers).
    The ops a row adds to a step (batch 8 against batch 2) grow from a 2-layer to a 6-layer llama by
    at most one op per extra layer more than ``full``'s do (its slabs are built per row and layer once
    per decode). Before, snapkv added ~4 ops per row and layer, tova ~18, rkv and scissorhands ~50. The
    host reads a step makes do not grow with the rows (before: raas ~4 per row, lazy_eviction ~9,
    raas_authors ~6)."""
    from kvleague.runner.bench.step_ops import count
    from kvleague.runner.models import load_engine
    from kvleague.runner.models.tiny import make_tiny_model

    names = (
        "full",
        "epikv",
        "h2o",
        "snapkv",
        "tova",
        "raas",
        "lazy_eviction",
        "thinkv",
        "rkv",
        "scissorhands",
        "kv_key",
        "lag_kv",
        "h2o_authors",
        "raas_authors",
        "longflow_authors",
    )
    per_row: dict[int, dict[str, float]] = {}
    reads_per_row: dict[str, float] = {}
    for layers in (2, 6):
        engine = load_engine(str(make_tiny_model("llama", tmp_path / f"l{layers}", layers=layers)), backend="slab")
        engine.eos_ids = set()
        engine.backend.graphs = True
        prompt = list(range(40, 80))
        per_row[layers] = {}
        for name in names:
            two, eight = (count(engine, name, n, 16, prompt, 4) for n in (2, 8))
            per_row[layers][name] = (eight["ops_per_step"] - two["ops_per_step"]) / 6
            reads_per_row[name] = max(
                reads_per_row.get(name, 0), (eight["host_reads_per_step"] - two["host_reads_per_step"]) / 6
            )
    growth = {name: per_row[6][name] - per_row[2][name] for name in names}
    assert growth["full"] > 0  # the slabs built per row and layer: the count sees the layers
    for name in names[1:]:
        assert growth[name] - growth["full"] <= 4, (name, growth)  # 4 extra layers
    # and no method reads a value on the host per row (a device synchronization each on a GPU)
    assert all(reads <= 0 for reads in reads_per_row.values()), reads_per_row


def test_a_sequence_s_step_does_not_loop_over_the_layers(tmp_path):
    """A sequence alone observes and scores over the layers at once, as a batch does (the window's
    attention, R-KV's redundancy, the newest rows SDPA does not give, H2O's sums, the bookkeeping): the
    ops of its decode step grow from a 2-layer to a 6-layer llama by no more than ``full``'s do (plus
    half an op per layer). Before (``63b8d02``) snapkv added ~35 ops per layer, rkv ~48, scissorhands
    ~44, tova and keydiff ~13, raas / lazy_eviction / thinkv ~11, h2o ~6.5, lag_kv ~5, against ``full``'s ~4."""
    from kvleague.runner.bench.step_ops import count
    from kvleague.runner.models import load_engine
    from kvleague.runner.models.tiny import make_tiny_model

    names = (
        "full",
        "epikv",
        "h2o",
        "snapkv",
        "tova",
        "rkv",
        "scissorhands",
        "keydiff",
        "raas",
        "lazy_eviction",
        "thinkv",
        "lag_kv",
        "kv_key",
        "h2o_authors",
    )
    ops: dict[tuple[str, int], float] = {}
    for layers in (2, 6):
        engine = load_engine(str(make_tiny_model("llama", tmp_path / f"l{layers}", layers=layers)), backend="slab")
        engine.eos_ids = set()
        engine.backend.graphs = True
        for name in names:
            ops[name, layers] = count(engine, name, 1, 16, list(range(40, 80)), 4)["ops_per_step"]
    per_layer = {name: (ops[name, 6] - ops[name, 2]) / 4 for name in names}
    assert per_layer["full"] > 0
    for name in names[1:]:
        assert per_layer[name] <= per_layer["full"] + 0.5, (name, per_layer)


def test_a_fed_one_token_turn_runs_eagerly_and_only_decode_steps_are_captured(tiny_models):
    """A one-token turn (a batch flushing a session's pending token) is fed eagerly on the slab
    backend, not captured per session and turn; the decode loop's steps are, once per (batch,
    capacity), and ``describe`` counts the shapes beside the captures."""
    from kvleague.engine.protocol import GenerationSettings, Protocol
    from kvleague.methods import build_method
    from kvleague.runner.models import load_engine

    engine = load_engine(str(tiny_models["llama"]), backend="slab")
    engine.eos_ids = set()
    backend = engine.backend
    backend.graphs = True
    with engine.session(build_method("full"), 64, Protocol()) as session:
        session.feed(list(range(40, 60)))
        steps, captures = dict(backend.steps), backend.captures
        session.feed([70])
        assert backend.captures == captures and backend.steps == {**steps, "eager": steps["eager"] + 1}
        session.decode(GenerationSettings(max_new_tokens=4))
    assert backend.steps["static"] - steps["static"] == 3 and backend.captures == captures + 1
    assert backend.describe()["graph_capture_shapes"] == 1
