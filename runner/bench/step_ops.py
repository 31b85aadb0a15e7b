"""Host work per decode step, counted: what a GPU's host pays around each captured decode step.

On a GPU the slab backend replays each decode step's forward as one CUDA graph; everything else in
the step (the decode loop's bookkeeping, the method's observe / score, the engine's selection and
moves) is dispatched op by op from the host, and every read of a device value on the host drains
the device's queue. This script counts on the CPU, where the counts are the same as anywhere, per
decode step and **outside** the captured body (the slab backend with ``graphs=True``, which runs the
body eagerly off CUDA, excluded from the count):

* ``ops``: the ATen ops dispatched;
* ``host reads``: those that read a tensor's value on the host (``HOST_READS``: ``item`` / ``bool``
  / ``int``, ``nonzero``, ``equal``, ...);
* ``to host``: ``tolist()`` and ``cpu()`` calls (``TO_HOST``: a copy to the host on a GPU, nothing
  dispatched on a CPU).

A CPU cannot tell a tensor the code keeps on the host (EpiKV's score tables, a method's per-position
state) from one that lives on the device, so both count: the reads and the copies to the host bound
the waits of a GPU's host on its device per step from above. Not counted: copies to the device
(``torch.tensor(..., device=)``, ``.to(device)`` of a host-made tensor; from pageable memory each
waits for the device's queue too): the step's tokens and positions, and per eviction a few small
tensors and the scores of a method that scores on the host. Prompts are fed before counting
starts; only decoding is counted. The benchmark counts a batched eviction as a GPU runs it (every
kept slot of an ordered eviction moves); on a CPU the engine reads where the first dropped slot is
and moves only the slots from there on (``cache_rows.evict_rows``: one host read and ~9 ops). Frozen
per-position scores (the EpiKV family's, KV-key / KV-val's) are read from their table's mirror, as on
a GPU (``kernels.MIRROR_ON_CPU``), methods whose scores are order-free but whose references keep
slots in order (``Needs.order_free_scores``) are evicted by filling holes, and eager attention reads
each KV head once (``grouped_eager``), as the slab backend does on a GPU.

And bytes, per decode step, told apart by where a tensor's memory is (the slabs, and the copies the
forward makes of them, such as K/V repeated per query head):

* ``K/V read``: bytes of the slabs (and their copies) that the forward's ops read (a broadcast
  dimension read once), against ``kept``: each row's kept slots and its new one x KV heads x head
  dim x 2 x layers x element size, what a kernel reading the kept slots once reads;
* ``moved``: bytes written by the eviction's ops that read or write the slabs (in place: what their
  source holds), against ``evicted``: the slots dropped x the same bytes per slot.

    python -m kvleague.runner.bench.step_ops [--methods full,epikv,h2o,snapkv] [--batch-sizes 1,8,32]
                                             [--budget 32] [--prompt-tokens 64] [--steps 32] [--recent 0]
                                             [--json OUT]

The default model is a random-weight llama of 4 layers, hidden 64, 4 / 2 heads, built offline (the
counts grow with layers; they do not depend on the weights). It takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: tensor methods that copy a tensor to the host (on a GPU; a CPU dispatches nothing for them)
TO_HOST = frozenset({"tolist", "cpu"})
#: ATen ops that read a tensor's value on the host (or size an output by it)
HOST_READS = frozenset(
    {
        "item",
        "_local_scalar_dense",
        "is_nonzero",
        "nonzero",
        "equal",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "bincount",
    }
)


def _bytes(t) -> int:
    """The bytes a kernel touches through view ``t``: a broadcast dimension (stride 0) is read once."""
    n = t.element_size()
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n


def _aliases(out, args) -> bool:
    """Whether ``out`` (a view op's) shares memory with a tensor among ``args``."""
    import torch

    if not isinstance(out, torch.Tensor):
        return True
    return any(
        isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for a in args
    )


def count(
    engine, name: str, batch: int, budget: int, prompt: list[int], steps: int, as_gpu: bool = False, recent: int = 0
) -> dict:
    """Per decode step of ``batch`` sequences under method ``name``: ops outside the captured body,
    host reads, K/V bytes the forward's attention reads and the bytes an eviction moves. ``as_gpu``:
    a batch's ordered eviction moves every kept slot, as on a GPU (not reading its first dropped slot)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    import kvleague.engine.cache_rows as cache_rows
    import kvleague.engine.decode as decode
    from kvleague.engine.cache import BudgetedCache
    from kvleague.engine.decode import DecodeLoop
    from kvleague.engine.protocol import GenerationSettings, Protocol
    from kvleague.engine.slab import GraphedStep
    from kvleague.methods import build_method, kernels

    def storage(t) -> int:
        return t.untyped_storage().data_ptr()

    class Counter(TorchDispatchMode):
        """Ops and host reads outside the captured body; and, by where a tensor's memory is, the K/V
        read in the forward (the slabs, and copies made of them there: a repeat per query head) and
        the bytes written by an eviction's ops that touch the slabs."""

        def __init__(self):
            super().__init__()
            self.ops = self.reads = self.to_host = self.inside = 0
            self.kv_read = self.kv_needed = self.moved = self.forwards = 0
            self.phase: str | None = None  # "forward", "evict" or None
            self.derived: set[int] = set()  # storages of the forward's copies of K/V

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not self.inside:
                self.ops += 1
                self.reads += func.overloadpacket.__name__ in HOST_READS
            out = func(*args, **kwargs)
            if self.phase is not None and not (func.is_view and _aliases(out, args)):  # a reshape may copy
                self._bytes(func, args, kwargs, out)
            return out

        def _bytes(self, func, args, kwargs, out) -> None:
            slabs = {storage(t) for t in slab_tensors()}
            read, written = [], []
            for arg, value in zip(
                func._schema.arguments, [*args, *(kwargs.get(a.name) for a in func._schema.arguments[len(args) :])]
            ):
                tensors = value if isinstance(value, (list, tuple)) else [value]
                for t in tensors:
                    if isinstance(t, torch.Tensor):
                        (written if arg.alias_info is not None and arg.alias_info.is_write else read).append(t)
            outs = [t for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]
            kv_in = [t for t in read if storage(t) in slabs or storage(t) in self.derived]
            if self.phase == "forward":
                self.kv_read += sum(_bytes(t) for t in kv_in)
                for t in outs:  # a copy of K/V (same slots and head dim): what a later op reads is K/V too
                    if any(t.dim() >= 2 and t.shape[-2:] == k.shape[-2:] for k in kv_in):
                        self.derived.add(storage(t))
            elif kv_in or any(storage(t) in slabs for t in written):
                # an op writing into a tensor in place (copy_, scatter_, index_copy_) writes what its
                # source holds, not the whole tensor
                source = max((_bytes(t) for t in read if t.dtype == (written or outs)[0].dtype), default=0)
                self.moved += sum(min(_bytes(t), source) for t in {id(t): t for t in written}.values())
                self.moved += sum(_bytes(t) for t in outs if all(t is not w for w in written))

    class Copies(TorchFunctionMode):
        """``tolist`` and ``cpu``: a copy to the host on a GPU, nothing dispatched on a CPU."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not counter.inside and getattr(func, "__name__", "") in TO_HOST:
                counter.to_host += 1
            return func(*args, **(kwargs or {}))

    counter = Counter()
    reorders = engine.backend.reorders_slots
    engine.backend.reorders_slots = reorders or as_gpu  # order-free scores fill holes, as on a GPU
    try:
        sessions = [engine.session(build_method(name), budget, Protocol(recent=recent)) for _ in range(batch)]
    finally:
        engine.backend.reorders_slots = reorders
    loops: list[DecodeLoop] = []

    def slab_tensors() -> list[torch.Tensor]:
        own = [s.cache.kv for s in sessions if getattr(s.cache, "kv", None) is not None]
        return own + [loop.kv for loop in loops if getattr(loop, "kv", None) is not None]

    def phase(name, real):
        def run(*a, **k):
            outer, counter.phase = counter.phase, name
            if name == "forward":
                counter.forwards += 1
                counter.derived = set()
                # the slots the step's attention needs: each row's kept slots and its new one
                slots = sum(s.cache.length + 1 for s in sessions)
                kv = slab_tensors()[-1]
                counter.kv_needed += slots * kv.shape[0] * kv.shape[3] * kv.shape[5] * 2 * kv.element_size()
            try:
                return real(*a, **k)
            finally:
                counter.phase = outer
                if name == "forward":  # its copies of K/V are freed: their memory may hold anything next
                    counter.derived = set()

        return run

    body = GraphedStep._body

    def uncounted(step, cache, tap):  # the captured body: one graph replay on a GPU
        counter.inside += 1
        try:
            return body(step, cache, tap)
        finally:
            counter.inside -= 1

    for session in sessions:
        with session:
            session.feed(prompt)
    evictions = sum(s.evicted_tokens for s in sessions)
    patches = [
        *([(cache_rows, "first_dropped", lambda keep: 0), (kernels, "MIRROR_ON_CPU", True)] if as_gpu else []),
        (GraphedStep, "_body", uncounted),
        (engine.backend, "forward", phase("forward", engine.backend.forward)),
        (decode, "evict_rows", phase("evict", decode.evict_rows)),
        (BudgetedCache, "evict", phase("evict", BudgetedCache.evict)),
    ]
    if as_gpu:  # eager attention in the KV heads as they are, as on a GPU
        patches.append((engine.backend, "grouped_eager", True))
    saved = [(obj, attr, obj.__dict__.get(attr)) for obj, attr, _ in patches]
    for obj, attr, value in patches:
        setattr(obj, attr, value)
    try:
        with Copies(), counter:
            loops.append(DecodeLoop(engine, sessions, GenerationSettings(max_new_tokens=steps + 1)))
            loops[0].run()
    finally:
        for obj, attr, value in saved:
            if value is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)
    kv = slab_tensors()[-1]
    slot_bytes = kv.shape[0] * kv.shape[3] * kv.shape[5] * 2 * kv.element_size()
    evicted = sum(s.evicted_tokens for s in sessions) - evictions
    row = {
        "method": name,
        "batch_size": batch,
        "ops_per_step": counter.ops / steps,
        "host_reads_per_step": counter.reads / steps,
        "to_host_per_step": counter.to_host / steps,
        "evictions": sessions[0].evictions,
        "kv_read_bytes_per_step": counter.kv_read / counter.forwards,
        "kv_read_ratio": counter.kv_read / max(counter.kv_needed, 1),
        "evicted_bytes_per_step": evicted * slot_bytes / steps,
        "moved_bytes_per_step": counter.moved / steps,
        "moved_ratio": counter.moved / max(evicted * slot_bytes, 1),
    }
    # this function's classes hold its closures, a cycle: let go of the sessions now, so that the slabs
    # they were bound to are handed on as they would be, not moved out inside the next count's steps
    sessions.clear()
    loops.clear()
    return row


def main(argv: list[str] | None = None) -> dict:
    import torch

    from kvleague.runner.bench import harness as h
    from kvleague.runner.models import load_engine
    from kvleague.runner.models.tiny import make_tiny_model

    p = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    p.add_argument("--methods", default="full,epikv,h2o,snapkv")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="decode steps counted")
    p.add_argument(
        "--recent", type=int, default=0, help="the protocol's recent window (default 0: the default protocol)"
    )
    p.add_argument("--model", help="checkpoint (default: a random-weight llama built offline, shaped below)")
    p.add_argument("--layers", type=int, default=4, help="the built llama's layers (16: the 0.57B model's)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4, help="query heads (32 / 8 KV heads: the 0.57B model's ratio)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(
            make_tiny_model(
                "llama",
                os.path.join(tmp, "llama"),
                layers=args.layers,
                hidden=args.hidden,
                heads=args.heads,
                kv_heads=args.kv_heads,
                seed=0,
            )
        )
        engine = load_engine(model, backend="slab")
        engine.eos_ids = set()
        engine.backend.graphs = True  # the captured body's path, run eagerly off CUDA
        prompt = h.random_prompt(args.prompt_tokens, seed=1)
        rows = [
            count(engine, m, b, args.budget, prompt, args.steps, as_gpu=True, recent=args.recent)
            for m in args.methods.split(",")
            for b in (int(x) for x in args.batch_sizes.split(","))
        ]
        label = h.model_label(engine, args.model)
    print(
        f"host work per decode step outside the captured step: {label}; prompt {args.prompt_tokens}, "
        f"B = {args.budget}, recent window {args.recent}, {args.steps} steps"
    )
    print(
        h.table(
            rows,
            [
                ("method", "method", ""),
                ("batch_size", "batch", "d"),
                ("ops_per_step", "ops/step", ".1f"),
                ("host_reads_per_step", "host reads/step", ".1f"),
                ("to_host_per_step", "to host/step", ".1f"),
                ("evictions", "evictions", "d"),
                ("kv_read_bytes_per_step", "K/V read B/step", ".0f"),
                ("kv_read_ratio", "read / kept", ".2f"),
                ("evicted_bytes_per_step", "evicted B/step", ".0f"),
                ("moved_bytes_per_step", "moved B/step", ".0f"),
                ("moved_ratio", "moved / evicted", ".2f"),
            ],
        )
    )
    report = {"config": vars(args), "model_label": label, "environment": h.environment(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
