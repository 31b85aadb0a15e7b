"""The slab backend (``engine/slab.py``) against the Hugging Face backend, the oracle.

Every registered method on tiny llama / qwen2 / qwen3 in float32, one sequence and a ragged batch:
the slab backend must give the same tokens, kept positions and eviction counts as ``backend: hf``.
Each architecture runs under a different protocol (sinks and a recent window; compact positions,
a buffered cadence and the prompt kept whole; chunked prefill and seeded sampling). Then what makes
it a slab backend: attention sees the whole fixed slab at every step, evictions never reallocate
it, and the graph-ready decode step (static buffers, device-held write slots, observations tapped
and handed over after the step) gives every method the same tokens, with no host synchronization
inside the step.
"""

from __future__ import annotations

import pytest
import torch

from kvleague.engine.batch import drive_sessions
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.engine.session import Session
from kvleague.methods import available_methods, build_method
from tests.conftest import ARCHS

# the batch tests' protocols (sinks and windows; compact positions, a buffered cadence and a kept
# prompt; chunked prefill and seeded sampling) and settings
from tests.test_batch import NEW_TOKENS, PROTOCOLS, SETTINGS

METHODS = sorted(available_methods())
BUDGET = 16
LENGTHS = (9, 20, 27)  # below and above the budget
#: methods that observe nothing at a decode step
UNOBSERVED = ("full", "keydiff", "knorm", "random", "streaming_llm")


@pytest.fixture(scope="module")
def pairs(tiny_models):
    """Per architecture, (hf engine, slab engine) over the same checkpoint, float32, no EOS."""
    from kvleague.runner.models import load_engine

    torch.set_num_threads(1)
    out = {}
    for arch, path in tiny_models.items():
        hf, slab = load_engine(str(path)), load_engine(str(path), backend="slab")
        hf.eos_ids, slab.eos_ids = set(), set()  # every sequence decodes NEW_TOKENS
        out[arch] = (hf, slab)
    return out


@pytest.fixture(scope="module")
def prompts(pairs) -> list[list[int]]:
    text = "Once the cache is full, every new token costs an old one; which one goes is the whole question. " * 2
    ids = pairs["llama"][0].tokenizer(text, add_special_tokens=False)["input_ids"]
    return [ids[3 * i : 3 * i + n] for i, n in enumerate(LENGTHS)]


def _same(oracle, result) -> None:
    assert result.token_ids == oracle.token_ids
    assert result.kept_positions == oracle.kept_positions
    for name in (
        "evictions",
        "evicted_tokens",
        "ranked_evictions",
        "peak_cache_entries",
        "generated_tokens",
        "attn_implementation",
        "completion",
    ):
        assert getattr(result, name) == getattr(oracle, name), name


def test_registered_methods_are_all_covered():
    assert len(METHODS) >= 26 and set(UNOBSERVED) <= set(METHODS)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", METHODS)
def test_slab_equals_hf_alone_and_batched(pairs, prompts, name, arch):
    hf, slab = pairs[arch]
    protocol, settings = PROTOCOLS[arch], SETTINGS[arch]
    seeds = list(range(7, 7 + len(prompts)))
    oracle = [hf.generate(p, build_method(name), BUDGET, protocol, settings, seed=s) for p, s in zip(prompts, seeds)]
    alone = [slab.generate(p, build_method(name), BUDGET, protocol, settings, seed=s) for p, s in zip(prompts, seeds)]
    batched = slab.generate_batch(prompts, [build_method(name) for _ in prompts], BUDGET, protocol, settings, seeds)
    for expected, single, in_batch in zip(oracle, alone, batched):
        _same(expected, single)
        _same(expected, in_batch)
    if not build_method(name).never_evicts:
        assert sum(r.evictions > 0 for r in oracle) >= 2


@pytest.mark.parametrize("name", ["snapkv", "h2o", "epikv"])
def test_multi_turn_sessions_and_teacher_forcing_equal_hf(pairs, prompts, name):
    """Feed, decode, feed again (the pending token flushed), decode; then teacher forcing as fidelity
    runs it: the same tokens, kept positions and (to float rounding) logits on both backends."""
    protocol, settings = Protocol(sink=1, recent=2, cadence="buffer=2"), GenerationSettings(max_new_tokens=6)
    out = {}
    for backend, engine in zip(("hf", "slab"), pairs["qwen3"]):
        logits = []
        with engine.session(build_method(name), BUDGET, protocol) as session:
            session.feed(prompts[1])
            first = session.decode(settings).token_ids
            session.feed(prompts[0])
            second = session.decode(settings).token_ids
            session.teacher_force(prompts[2][:8], lambda l, t: logits.append(l.clone()))  # noqa: B023 - called before the loop moves on
            out[backend] = (first, second, session.kept_positions(), session.evictions, torch.stack(logits))
    hf, slab = out["hf"], out["slab"]
    assert slab[:4] == hf[:4]
    torch.testing.assert_close(slab[4], hf[4], rtol=1e-5, atol=1e-5)


def _watch_key_widths(monkeypatch, engine) -> list[int]:
    """The key length every decode step's attention call of ``engine`` sees (one query per row)."""
    import transformers.modeling_utils as mu

    widths = []
    name = engine.model.config._attn_implementation
    inner = mu.ALL_ATTENTION_FUNCTIONS[name]

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        if query.shape[-2] == 1:
            widths.append(key.shape[-2])
        return inner(module, query, key, value, attention_mask, *args, **kwargs)

    # the mapping that wins: a local entry (kvpress's import-time patch sets one for every kernel) overrides the global
    functions = mu.ALL_ATTENTION_FUNCTIONS
    monkeypatch.setitem(
        functions._local_mapping if name in functions._local_mapping else functions._global_mapping, name, spy
    )
    return widths


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batch"])
def test_decode_steps_see_the_whole_fixed_slab_and_evictions_never_reallocate(pairs, prompts, monkeypatch, batched):
    hf, slab = pairs["llama"]
    protocol, settings = Protocol(sink=1, prefill_chunk=5), GenerationSettings(max_new_tokens=12)
    with slab.session(build_method("snapkv"), BUDGET, protocol) as session:
        session.feed(prompts[1])
        buffers = [layer.buffers[0].data_ptr() for layer in session.cache.cache.layers]
        capacity = session.cache.cache.layers[0].capacity
        assert capacity == BUDGET + 5  # budget + the prefill chunk (no pass of it is a single token)
        widths = _watch_key_widths(monkeypatch, slab)
        if batched:
            results = slab.generate_batch(
                prompts, [build_method("snapkv") for _ in prompts], BUDGET, protocol, settings
            )
            assert all(r.evictions for r in results[1:])
        else:
            session.decode(settings)
            assert session.evictions > 3
            assert [layer.buffers[0].data_ptr() for layer in session.cache.cache.layers] == buffers
            assert session.cache.cache.layers[0].capacity == capacity
        monkeypatch.undo()
    assert len(widths) >= 11 * hf.n_layers and len(set(widths)) == 1, set(widths)
    assert widths[0] == (capacity if not batched else BUDGET + 1)  # a batch's slab: B + the cadence's buffer + 1


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batch"])
@pytest.mark.parametrize("name", ["epikv", "snapkv"])  # scores [T] (one plan) and [L, H_kv, T]
def test_an_eviction_moves_every_layer_with_one_gather(pairs, prompts, monkeypatch, name, batched):
    """Every layer's K and V are views of one tensor (a sequence's store, or a batch's slabs), and each
    eviction moves the kept slots of all layers with one gather, never layer by layer (the tests above
    show that it keeps what the HF store keeps)."""
    from kvleague.engine import cache_rows as rows_module
    from kvleague.engine import slab as slab_module
    from kvleague.engine.cache import BudgetedCache

    _, slab = pairs["llama"]
    gathered = []
    for module in (rows_module, slab_module):
        real = module.gather_slots
        monkeypatch.setattr(
            module, "gather_slots", lambda kv, *a, _real=real, **k: gathered.append(kv.shape) or _real(kv, *a, **k)
        )
    monkeypatch.setattr(BudgetedCache, "_evict_layer", lambda *a: pytest.fail("a layer evicted on its own"))
    protocol, settings = Protocol(sink=1), GenerationSettings(max_new_tokens=8)
    if batched:
        results = slab.generate_batch(prompts, [build_method(name) for _ in prompts], BUDGET, protocol, settings)
        evictions = sum(r.evictions for r in results)
        assert len(gathered) <= evictions - 1 and {shape[:2] for shape in gathered} == {(slab.n_layers, 2)}
        return
    with slab.session(build_method(name), BUDGET, protocol) as session:
        session.feed(prompts[2])  # 27 tokens: the prompt is compressed
        store = session.cache
        assert all(
            b.untyped_storage().data_ptr() == store.kv.untyped_storage().data_ptr()
            for layer in store.cache.layers
            for b in layer.buffers
        )
        session.decode(settings)
        assert session.evictions >= 8 and len(gathered) == session.evictions
        assert all(shape[:3] == (slab.n_layers, 2, 1) for shape in gathered)


def _captures_of_a_long_decode(pairs, prompts, monkeypatch) -> list[int]:
    """The capacities captured while ``full`` decodes 300 tokens on the graph's path (a budget past
    the context: no eviction), its tokens checked against hf's."""
    from kvleague.engine.slab import GraphedStep

    hf, slab = pairs["llama"]
    captured = []
    init = GraphedStep.__init__
    monkeypatch.setattr(
        GraphedStep,
        "__init__",
        lambda self, backend, n, capacity: captured.append(capacity) or init(self, backend, n, capacity),
    )
    monkeypatch.setattr(slab.backend, "graphs", True)
    settings = GenerationSettings(max_new_tokens=300)
    budget = slab.model.config.max_position_embeddings + 1
    oracle = hf.generate(prompts[0], build_method("full"), budget, Protocol(), settings)
    _same(oracle, slab.generate(prompts[0], build_method("full"), budget, Protocol(), settings))
    return captured


def test_a_slab_that_must_grow_grows_before_its_step_is_captured(pairs, prompts, monkeypatch):
    """A method that never evicts fills its slab, which grows (geometrically) on the graph's path
    before the step is keyed by the slabs' addresses: one capture per capacity, not a second one
    keyed by the slabs the step itself replaced; the tokens stay hf's. (A decode loop sizes such a
    slab for the whole decode first, ``SlabStore.expect``: off here, so that it grows.)"""
    from kvleague.engine.slab import SlabStore

    monkeypatch.setattr(SlabStore, "expect", lambda self, slots: None)
    captured = _captures_of_a_long_decode(pairs, prompts, monkeypatch)
    assert len(captured) >= 2 and len(captured) == len(set(captured)), captured


def test_a_decode_that_never_evicts_runs_at_one_capacity_sized_for_it(pairs, prompts, monkeypatch):
    """The decode loop sizes a never-evicting sequence's slab for its prompt and every new token at
    once (as a batch's slabs are): one capture, at that capacity, and hf's tokens; a captured step
    reads its whole slab, so a slab grown by half again as it fills reads up to 1.5x what it holds."""
    captured = _captures_of_a_long_decode(pairs, prompts, monkeypatch)
    assert captured == [len(prompts[0]) + 300], captured


@pytest.mark.parametrize("name", ["epikv", "snapkv", "tova"])
def test_a_gather_of_a_few_layers_at_a_time_keeps_what_hf_keeps(pairs, prompts, monkeypatch, name):
    """Where one gather of every layer's kept slots would copy out more than ``GATHER_BYTES`` (a
    large cache), the layers go a few at a time: here one at a time, alone and batched, against hf."""
    from kvleague.engine import compaction

    hf, slab = pairs["qwen3"]
    protocol, settings = PROTOCOLS["qwen3"], SETTINGS["qwen3"]
    alone = [hf.generate(p, build_method(name), BUDGET, protocol, settings, seed=3) for p in prompts]
    batched = hf.generate_batch(
        prompts, [build_method(name) for _ in prompts], BUDGET, protocol, settings, [3] * len(prompts)
    )
    monkeypatch.setattr(compaction, "GATHER_BYTES", 1)
    for oracle, result in zip(
        alone, [slab.generate(p, build_method(name), BUDGET, protocol, settings, seed=3) for p in prompts]
    ):
        _same(oracle, result)
    for oracle, result in zip(
        batched,
        slab.generate_batch(
            prompts, [build_method(name) for _ in prompts], BUDGET, protocol, settings, [3] * len(prompts)
        ),
    ):
        _same(oracle, result)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", METHODS)
def test_the_graph_ready_step_equals_hf(pairs, prompts, name, arch):
    """``graphs=True`` off CUDA runs the captured step's body eagerly: static buffers, K/V written at
    device-held slots, the mask copied in, what the method observes tapped and rewritten in place
    at every step (as a replay rewrites a graph's memory) before it is handed over. Every method,
    observing or not: same tokens and kept positions as the oracle, every decode step on that path."""
    hf, slab = pairs[arch]
    protocol, settings = PROTOCOLS[arch], SETTINGS[arch]
    oracle = [hf.generate(p, build_method(name), BUDGET, protocol, settings, seed=3) for p in prompts]
    backend = slab.backend
    backend.graphs = True
    try:
        before = dict(backend.steps)
        alone = [slab.generate(p, build_method(name), BUDGET, protocol, settings, seed=3) for p in prompts]
        batched = slab.generate_batch(
            prompts, [build_method(name) for _ in prompts], BUDGET, protocol, settings, [3] * 3
        )
        assert backend.steps["static"] - before["static"] == (len(prompts) + 1) * (NEW_TOKENS - 1)  # 3 alone, 1 batch
        assert backend.steps["eager"] == before["eager"]
    finally:
        backend.graphs = False
    for expected, single, in_batch in zip(oracle, alone, batched):
        _same(expected, single)
        _same(expected, in_batch)


@pytest.mark.parametrize("name", ["h2o", "epikv", "snapkv"])
def test_one_token_prompts_and_turns_on_the_graph_ready_path_equal_hf(pairs, prompts, name):
    """A one-token prompt is a pass of one token before the sequence has slabs: it runs eagerly and
    allocates them (it used to take the captured step's path and fail on the missing slabs, on CUDA
    for every one-token prompt). A one-token second turn, alone and in a batch, runs eagerly too
    (it used to be captured: one capture per session and turn where a batch flushes pending tokens);
    only the decode loop's steps are captured."""
    hf, slab = pairs["llama"]
    protocol, settings = Protocol(sink=1, recent=2), GenerationSettings(max_new_tokens=6)
    turns = [[prompts[2][:1], prompts[1][:1]], [prompts[2][:1], prompts[0]], [prompts[2], prompts[1][:1]]]

    def play(session, fed):  # a sequence's turns, on its session (or, batched, its handle)
        for ids in fed:
            session.feed(ids)
            session.decode(settings)

    def run(engine, batched):
        sessions = [Session(engine, build_method(name), BUDGET, protocol, 0) for _ in turns]
        if batched:  # each turn's decodes together (the engine's multi-turn batching)
            drive_sessions(engine, sessions, [lambda handle, fed=fed: play(handle, fed) for fed in turns])
        else:
            for session, fed in zip(sessions, turns):
                with session:
                    play(session, fed)
        return [session.result() for session in sessions]

    oracle = run(hf, False)
    slab.backend.graphs = True
    try:
        before = dict(slab.backend.steps)
        results = run(slab, False) + run(slab, True)
        # the four first passes of one token and the four one-token second turns (2 of each per run)
        assert slab.backend.steps["eager"] - before["eager"] == 8
    finally:
        slab.backend.graphs = False
    for expected, result in zip(oracle + oracle, results):
        _same(expected, result)


@pytest.mark.parametrize(
    "name, batch_size", [("tova", 8), ("epikv", 8), ("h2o", 8), ("epikv", 3), ("h2o", 3)]
)  # (knorm parts at rounding ties here: tests/rounding_ties.py)
def test_finished_rows_stay_as_padding_so_a_batch_captures_about_log2_n_times(pairs, name, batch_size, monkeypatch):
    """With captured steps, rows whose sequence ended (EOS at different steps) stay in the slabs as
    padding until fewer than half are live: every sequence still equals ``hf`` alone, and the batch
    builds few graphs (a new one per batch size, not per finished row). Eight prompts through three
    rows: each finished row is taken by the next prompt (continuous batching), at the same batch size,
    so the rows' turnover costs no capture."""
    from kvleague.engine import slab as slab_module

    hf, slab = pairs["llama"]
    text = "Every new token costs an old one; which one goes is the whole question, and the answer differs. " * 3
    ids = hf.tokenizer(text, add_special_tokens=False)["input_ids"]
    batch = [ids[2 * i : 2 * i + 12 + i] for i in range(8)]
    protocol, settings = Protocol(sink=1, recent=2), GenerationSettings(max_new_tokens=16)
    free = [hf.generate(p, build_method(name), BUDGET, protocol, settings) for p in batch]
    counts = torch.bincount(torch.tensor([t for r in free for t in r.token_ids[1:]]))
    eos = {int(counts.argmax())}  # the commonest token ends sequences at different steps
    monkeypatch.setattr(hf, "eos_ids", eos)
    monkeypatch.setattr(slab, "eos_ids", eos)
    alone = [hf.generate(p, build_method(name), BUDGET, protocol, settings) for p in batch]
    assert len({r.generated_tokens for r in alone}) >= 4  # rows finish at four or more different steps
    captures = []
    init = slab_module.GraphedStep.__init__
    monkeypatch.setattr(slab_module.GraphedStep, "__init__", lambda self, *a: captures.append(a[1]) or init(self, *a))
    slab.backend.graphs = True
    slab.backend._graphed.clear()  # an earlier test's graphs of these shapes would replay
    before = slab.describe()["graph_captures"]
    try:
        batched = slab.generate_batch(
            batch, [build_method(name) for _ in batch], BUDGET, protocol, settings, batch_size=batch_size
        )
    finally:
        slab.backend.graphs = False
    for expected, result in zip(alone, batched):
        _same(expected, result)
    # batch sizes 8 (or 3 while prompts wait), then at most three halvings (3: one, to 1)
    assert captures[0] == batch_size and len(captures) <= (4 if batch_size == 8 else 2), captures
    assert slab.describe()["graph_captures"] - before == len(captures)  # what a run reports it paid


def test_a_sequence_bound_to_a_batch_row_lets_its_own_slabs_go(pairs, prompts):
    """A fed sequence joining a batch is copied into its row; its own slabs go then, not when the
    batch ends (a continuous batch's finished sequences would hold a prefill's slabs each): back to
    the backend's pool, which keeps one slab of a shape for the next sequence and lets the rest go."""
    import gc
    import weakref

    from kvleague.engine.decode import DecodeLoop

    _, slab = pairs["llama"]
    sessions = [Session(slab, build_method("h2o"), BUDGET, Protocol(), 0) for _ in range(2)]
    for session, prompt in zip(sessions, prompts[:2]):
        with session:
            session.feed(prompt)
    own = [weakref.ref(s.cache.kv) for s in sessions]
    assert all(r() is not None for r in own)
    slab.backend.pool.clear()
    loop = DecodeLoop(slab, sessions, GenerationSettings(max_new_tokens=3))
    gc.collect()
    assert all(s.cache.kv is None for s in sessions) and [r() is None for r in own] == [False, True]
    slab.backend.pool.clear()
    gc.collect()
    assert all(r() is None for r in own)
    loop.run()
    assert all(len(s.generated) == 3 for s in sessions)
    # continuous batching: a finished sequence whose row the next prompt took is let go whole
    waiting = [Session(slab, build_method("h2o"), BUDGET, Protocol(), 0) for _ in range(2)]
    for session, prompt in zip(waiting, prompts[1:]):
        with session:
            session.feed(prompt)
    finished = [weakref.ref(s) for s in sessions]
    loop = DecodeLoop(
        slab, sessions, GenerationSettings(max_new_tokens=3), refill=lambda: waiting.pop() if waiting else None
    )
    del sessions, session
    loop.run()
    gc.collect()
    assert all(r() is None for r in finished) and not waiting


def test_handed_over_observations_are_copies_and_describe_says_which_path_ran(pairs, prompts):
    """A method that keeps what it observed keeps it: the tapped tensors are rewritten by the next
    step, the ones handed over are not (the hidden states epikv sees, the queries snapkv sees)."""
    from kvleague.engine.contract import Observation

    _, slab = pairs["llama"]
    backend = slab.backend
    seen = []

    class Keeper(type(build_method("snapkv"))):
        def observe(self, obs: Observation) -> None:
            if obs.phase == "decode":
                assert obs.queries is not None  # snapkv asks for them
                seen.append((obs.queries[0], obs.queries[0].clone()))
            super().observe(obs)

    backend.graphs = True
    try:
        before = dict(backend.steps)
        slab.generate(prompts[2], Keeper(), BUDGET, Protocol(), GenerationSettings(max_new_tokens=5))
        assert backend.steps["static"] - before["static"] == 4 and backend.steps["eager"] == before["eager"]
    finally:
        backend.graphs = False
    assert len(seen) == 4 and all(torch.equal(kept, snapshot) for kept, snapshot in seen)
    assert not torch.equal(seen[0][1], seen[1][1])  # the steps did observe different queries
    about = slab.describe()
    assert (
        about["backend"] == "slab"
        and about["cuda_graphs"] == "off"
        and set(about["decode_steps"]) == {"eager", "graph", "static"}
    )


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_a_live_graph_keeps_no_finished_session_s_slabs_alive(pairs, prompts, monkeypatch, batched):
    """The graph reads and writes the slabs by address, its key holds those addresses, and nothing in
    it holds the slabs: once the sessions end, only the backend's pool holds theirs (for the next
    sessions of their shapes, which replay the graph instead of capturing anew), and emptied, nothing."""
    import gc
    import weakref

    from kvleague.engine import slab as slab_module

    _, slab = pairs["llama"]
    seen = []
    run = slab_module.GraphedStep.run

    def watched(self, cache, *args):
        seen.extend(weakref.ref(b) for layer in cache.layers for b in slab_module._slabs(layer))
        return run(self, cache, *args)

    monkeypatch.setattr(slab_module.GraphedStep, "run", watched)
    slab.backend.graphs = True
    try:
        if batched:
            slab.generate_batch(
                prompts,
                [build_method("snapkv") for _ in prompts],
                BUDGET,
                PROTOCOLS["llama"],
                GenerationSettings(max_new_tokens=4),
            )
        else:
            slab.generate(
                prompts[2], build_method("snapkv"), BUDGET, PROTOCOLS["llama"], GenerationSettings(max_new_tokens=4)
            )
    finally:
        slab.backend.graphs = False
    slab.backend.pool.clear()
    gc.collect()
    assert slab.backend._graphed and seen  # a graph is live, and it ran over these slabs
    assert all(ref() is None for ref in seen)


@pytest.mark.parametrize("op", ["item", "bool", "tolist", "int", "tensor", "nonzero", "boolean index", "cpu"])
def test_the_host_sync_spy_names_what_a_graph_cannot_hold(op):
    from tests.host_syncs import HostSyncs

    t = torch.arange(6.0)
    run = {
        "item": lambda: t[0].item(),
        "bool": lambda: bool((t > 2).any()),
        "tolist": t.tolist,
        "int": lambda: int(t[1]),
        "tensor": lambda: torch.tensor([1, 2]),
        "nonzero": t.nonzero,
        "boolean index": lambda: t[t > 2],
        "cpu": t.cpu,
    }[op]
    with HostSyncs() as spy:
        (t * 2 + 1).softmax(-1)[torch.arange(3)]  # device work, an integer index: nothing to name
        assert spy.found == []
        run()
    assert len(spy.found) >= 1 and spy.found[0][1].split("/")[-1].startswith(
        "test_backend_slab.py:"
    )  # the line that did it


def test_the_spy_knows_the_repositorys_code_by_where_it_is_not_by_folder_names(tmp_path):
    """A clone named ``kvleague`` with its venv inside: the venv's files are not the repository's code
    (a word in a path is no test of that), a repository file is, through a link too."""
    from tests.host_syncs import REPO, is_repository_code

    venv_file = REPO / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "_dynamo" / "eval_frame.py"
    assert not is_repository_code(str(venv_file))
    assert not is_repository_code("/elsewhere/kvleague/runner/tests/methods/x.py")
    assert is_repository_code(str(REPO / "kvleague" / "engine" / "slab.py"))  # kvleague/engine -> ../engine
    assert is_repository_code(__file__)
    (tmp_path / "kvleague").symlink_to(REPO / "methods")
    assert is_repository_code(str(tmp_path / "kvleague" / "epikv.py"))  # where it really is


@pytest.mark.parametrize("name", METHODS)
def test_the_captured_step_never_waits_for_the_host(pairs, prompts, monkeypatch, name):
    """The body a CUDA graph captures (model forward over the slab, K/V written at device-held
    slots, observations tapped) makes no op that reads a device value on the host or builds a tensor
    from host data, for every method alone and batched: it can be captured and replayed as is."""
    from kvleague.engine.slab import GraphedStep
    from tests.host_syncs import HostSyncs

    _, slab = pairs["llama"]
    body, found, bodies = GraphedStep._body, [], []

    def spied(self, cache, tap):
        with HostSyncs() as spy:
            out = body(self, cache, tap)
        found.extend(spy.found)
        bodies.append(1)
        return out

    monkeypatch.setattr(GraphedStep, "_body", spied)
    slab.backend.graphs = True
    try:
        slab.generate(prompts[2], build_method(name), BUDGET, PROTOCOLS["llama"], GenerationSettings(max_new_tokens=4))
        slab.generate_batch(
            prompts,
            [build_method(name) for _ in prompts],
            BUDGET,
            PROTOCOLS["llama"],
            GenerationSettings(max_new_tokens=4),
        )
    finally:
        slab.backend.graphs = False
    assert len(bodies) == 6 and found == []


def test_unknown_backend_and_flash_attention_are_one_line_errors(tiny_models):
    from kvleague.engine.slab import SlabBackend
    from kvleague.runner.models import load_engine

    with pytest.raises(KvleagueError, match="backend: unknown 'vllm'; allowed: hf, slab"):
        load_engine(str(tiny_models["llama"]), backend="vllm")
    hf = load_engine(str(tiny_models["llama"]))
    with pytest.raises(KvleagueError, match="backend slab: attn_implementation 'flash_attention_2'"):
        SlabBackend(hf.model, hf.tokenizer, "flash_attention_2")


def test_benchmarks_run_both_backends_side_by_side(tiny_models, tmp_path, capsys):
    """``--backend hf --backend slab``: one report, every figure tagged with its backend, and the slab
    backend's tokens/s over hf's per figure (the CPU's numbers; the tokens are the test above's job)."""
    from kvleague.runner.bench import harness as h
    from tests.test_bench import _cli

    model = str(tiny_models["llama"])
    _cli(
        [
            "bench",
            "generate",
            "--model",
            model,
            "--prompt-tokens",
            "24",
            "--new-tokens",
            "8",
            "--rounds",
            "1",
            "--backend",
            "hf",
            "--backend",
            "slab",
            "--static-anchor",
            "--json",
            str(tmp_path / "g.json"),
        ]
    )
    g = h.read_report(tmp_path / "g.json")
    assert g["config"]["backends"] == ["hf", "slab"] and set(g["summary"]["by_backend"]) == {"hf", "slab"}
    assert all(s["same_tokens"] for s in g["summary"]["by_backend"].values())  # both reproduce model.generate
    runners = ("generate", "engine", "generate_static")
    assert {(r["backend"], r["method"]) for r in g["rows"]} == {(b, m) for b in ("hf", "slab") for m in runners}
    # beside the static-cache anchor (not compiled off CUDA: transformers compiles on CUDA only), same tokens
    static = [f for f in g["figures"] if f["metric"] == "speed_ratio" and f["reference"] == "generate_static"]
    assert len(static) == 2 and all(f["details"]["same_tokens"] and f["details"]["compiled"] is False for f in static)
    assert h._LOADED is not None and h._LOADED[0] == model  # both backends ran one loaded model object
    ratios = [f for f in g["figures"] if f["metric"] == "backend_speed_ratio"]
    assert {(f["method"], f["details"]["backend"], f["reference"]) for f in ratios} == {
        (m, "slab", "backend hf") for m in runners
    }
    assert all(f["value"] > 0 for f in ratios)
    _cli(
        [
            "bench",
            "speed",
            "--model",
            model,
            "--budgets",
            "8",
            "--methods",
            "knorm",
            "--gen-factor",
            "2",
            "--backend",
            "slab",
            "--json",
            str(tmp_path / "s.json"),
        ]
    )
    s = h.read_report(tmp_path / "s.json")
    assert s["config"]["backend"] == "slab" and {r["backend"] for r in s["rows"]} == {"slab"}
    assert all(r["evictions"] == (0 if r["method"] == "full" else r["steps"]) for r in s["rows"])
    assert "backends side by side" in capsys.readouterr().out


@pytest.fixture(scope="module")
def cuda_pair(tiny_models):
    """(hf engine, slab engine) on CUDA, float32, no EOS: loaded once for every method."""
    from kvleague.runner.models import load_engine

    hf = load_engine(str(tiny_models["qwen3"]), dtype="float32", device="cuda")
    slab = load_engine(str(tiny_models["qwen3"]), dtype="float32", device="cuda", backend="slab")
    hf.eos_ids, slab.eos_ids = set(), set()
    # hf's slot order and eager kernel, so the methods' scores see what hf's do (each tested on its own:
    # tests/test_slot_order.py, tests/test_grouped_eager.py)
    slab.backend.reorders_slots = slab.backend.grouped_eager = False
    return hf, slab


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", METHODS)
def test_captured_decode_steps_equal_hf_on_cuda(cuda_pair, prompts, name):
    """On CUDA (``scripts/gpu_check.sh``; never run yet, no GPU was lent): float32, the slab backend
    with every decode step replayed as a CUDA graph (observing methods too) against the hf backend on
    the same GPU, alone and batched."""
    hf, slab = cuda_pair
    protocol, settings = Protocol(sink=1, recent=2), GenerationSettings(max_new_tokens=NEW_TOKENS)
    oracle = [hf.generate(p, build_method(name), BUDGET, protocol, settings) for p in prompts]
    before = dict(slab.describe()["decode_steps"])
    alone = [slab.generate(p, build_method(name), BUDGET, protocol, settings) for p in prompts]
    batched = slab.generate_batch(prompts, [build_method(name) for _ in prompts], BUDGET, protocol, settings)
    for expected, single, in_batch in zip(oracle, alone, batched):
        _same(expected, single)
        _same(expected, in_batch)
    steps = {k: v - before[k] for k, v in slab.describe()["decode_steps"].items()}
    assert steps == {"graph": (len(prompts) + 1) * (NEW_TOKENS - 1), "eager": 0, "static": 0}
