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
starts; only decoding is counted. One count differs from a GPU's: on a CPU a batched eviction reads
where its first dropped slot is (``cache_rows.evict_rows``: one host read and ~9 ops per eviction, which
a GPU skips).

    python -m kvleague.runner.bench.step_ops [--methods full,epikv,h2o,snapkv] [--batch-sizes 1,8,32]
                                             [--budget 32] [--prompt-tokens 64] [--steps 32] [--json OUT]

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


def count(engine, name: str, batch: int, budget: int, prompt: list[int], steps: int) -> dict:
    """Per decode step of ``batch`` sequences under method ``name``: ops outside the captured body and host reads."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvleague.engine.decode import DecodeLoop
    from kvleague.engine.protocol import GenerationSettings, Protocol
    from kvleague.engine.slab import GraphedStep
    from kvleague.methods import build_method

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = self.reads = self.to_host = self.inside = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.inside:
                self.ops += 1
                self.reads += func.overloadpacket.__name__ in HOST_READS
            return func(*args, **(kwargs or {}))

    class Copies(TorchFunctionMode):
        """``tolist`` and ``cpu``: a copy to the host on a GPU, nothing dispatched on a CPU."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not counter.inside and getattr(func, "__name__", "") in TO_HOST:
                counter.to_host += 1
            return func(*args, **(kwargs or {}))

    counter = Counter()
    body = GraphedStep._body

    def uncounted(step, cache, tap):  # the captured body: one graph replay on a GPU
        counter.inside += 1
        try:
            return body(step, cache, tap)
        finally:
            counter.inside -= 1

    sessions = [engine.session(build_method(name), budget, Protocol()) for _ in range(batch)]
    for session in sessions:
        with session:
            session.feed(prompt)
    GraphedStep._body = uncounted
    try:
        with Copies(), counter:
            DecodeLoop(engine, sessions, GenerationSettings(max_new_tokens=steps + 1)).run()
    finally:
        GraphedStep._body = body
    return {
        "method": name,
        "batch_size": batch,
        "ops_per_step": counter.ops / steps,
        "host_reads_per_step": counter.reads / steps,
        "to_host_per_step": counter.to_host / steps,
        "evictions": sessions[0].evictions,
    }


def main(argv: list[str] | None = None) -> dict:
    import torch

    from kvleague.runner.bench import harness as h
    from kvleague.runner.models import load_engine
    from kvleague.runner.models.tiny import make_tiny_model

    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--methods", default="full,epikv,h2o,snapkv")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="decode steps counted")
    p.add_argument("--model", help="checkpoint (default: a 4-layer random-weight llama built offline)")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_tiny_model("llama", os.path.join(tmp, "llama"), seed=0))
        engine = load_engine(model, backend="slab")
        engine.eos_ids = set()
        engine.backend.graphs = True  # the captured body's path, run eagerly off CUDA
        prompt = h.random_prompt(args.prompt_tokens, seed=1)
        rows = [
            count(engine, m, b, args.budget, prompt, args.steps)
            for m in args.methods.split(",")
            for b in (int(x) for x in args.batch_sizes.split(","))
        ]
        label = h.model_label(engine, args.model)
    print(
        f"host work per decode step outside the captured step: {label}; prompt {args.prompt_tokens}, "
        f"B = {args.budget}, {args.steps} steps"
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
