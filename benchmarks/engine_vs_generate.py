"""Decode speed of the kvleague engine (no eviction) against ``model.generate`` on the same model.

Both generate the same number of greedy tokens from the same prompt; runs alternate so machine noise
hits both alike, and the median of each is compared. Prints the ratio engine / generate (target >= 0.9).

    python benchmarks/engine_vs_generate.py [--model DIR_OR_ID] [--new-tokens 256] [--repeats 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from methods import build_method  # noqa: E402
from runner.engine import Engine  # noqa: E402
from runner.protocol import GenerationSettings  # noqa: E402
from runner.tiny_model import make_tiny_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint dir or HF id (default: a tiny llama built offline)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    model = args.model or str(make_tiny_model("llama", tempfile.mkdtemp(), layers=args.layers, hidden=args.hidden, heads=8, kv_heads=2))
    engine = Engine.load(model)
    params = sum(p.numel() for p in engine.model.parameters())
    prompt = torch.randint(0, 256, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    settings = GenerationSettings(max_new_tokens=args.new_tokens)
    eos_free = dict(eos_token_id=None, pad_token_id=0, min_new_tokens=args.new_tokens)  # both run the full length

    def run_generate() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            engine.model.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens, do_sample=False, **eos_free)
        return args.new_tokens / (time.perf_counter() - start)

    def run_engine() -> float:
        engine.eos_ids = set()  # same token count as generate with min_new_tokens
        start = time.perf_counter()
        engine.generate(prompt, build_method("full"), budget=1 << 30, settings=settings)
        return args.new_tokens / (time.perf_counter() - start)

    run_generate(), run_engine()  # warm-up
    gen, eng = [], []
    for _ in range(args.repeats):
        gen.append(run_generate())
        eng.append(run_engine())
    figures = {
        "model": model if args.model else f"tiny llama, {params / 1e6:.1f}M params",
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "generate_tokens_per_s": statistics.median(gen),
        "engine_tokens_per_s": statistics.median(eng),
        "ratio_engine_over_generate": statistics.median(eng) / statistics.median(gen),
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__, "cpu_threads": torch.get_num_threads()},
    }
    print(f"model: {figures['model']}  prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, {args.repeats} alternating runs")
    print(f"model.generate : {figures['generate_tokens_per_s']:8.1f} tokens/s")
    print(f"kvleague engine: {figures['engine_tokens_per_s']:8.1f} tokens/s")
    print(f"ratio engine / generate: {figures['ratio_engine_over_generate']:.3f}  (target >= 0.9)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
