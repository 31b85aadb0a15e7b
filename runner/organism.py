"""The *organism*: a small Llama trained here, on CPU, on the synthetic tasks of :mod:`tasks.synthetic`.

``kvleague train-organism`` (see :mod:`runner.organism_commands`) calls :func:`train`.

Status: not at target yet (>= 90% held-out accuracy with a full cache), so no checkpoint is shipped
and ``models/organism`` is not in the repository. The last run of this configuration (2,200 steps,
22 minutes on one CPU thread, answers then written ``k k=75`` so that the key sat right before its
fact token) ended at an answer loss of ~1.8: it wrote a fact token with the asked key but a wrong
value, 0-5% right on 20 held-out samples per task.

Design (everything here is chosen so a 2-core CPU learns the tasks in well under 30 minutes):

* **model**: ``LlamaForCausalLM``, 2 layers, hidden 192, 6 query heads and 2 KV heads (GQA), SwiGLU
  512, RoPE, tied embeddings; the tokenizer of :mod:`runner.organism_tokenizer` (built offline,
  5.7k pieces), which makes every fact ``k=42`` of the tasks one token, so an answer is a one-step
  lookup (a fact split over two tokens needs an induction circuit that did not form within 30 CPU
  minutes, see that module);
* **data**: an endless, seeded stream of the four synthetic tasks in equal parts (batch ``b`` of
  step ``s`` is a pure function of ``(seed, s)``, so the data order is deterministic and independent
  of timing). Every training sequence is the task's prompt, rendered with the tokenizer's ChatML
  template exactly as :meth:`tasks.base.Task.build_prompt` renders it, followed by the answer and
  ``<|im_end|>``; then ``extra_questions`` more user turns asking about other facts of the same
  context, each answered. The extra turns multiply the supervised retrievals per token of context
  (the scored first question is always the one the evaluation asks);
* **loss**: cross-entropy on the answer tokens (and their closing ``<|im_end|>``) only; the prompt
  is context (``prompt_loss_weight`` = 0 by default, a knob);
* **warm-up**: the first ``lookup_steps`` steps are only *lookup rows* (2 to 16 facts, then
  questions about all of them; the number of facts grows over the warm-up: with two or three places
  to look, attention finds the right one by chance often enough for the gradient to build the
  lookup); afterwards they are ``lookup_share`` of every batch;
* **curriculum**: prompt lengths are drawn uniformly from ``[min_length, cap]`` where ``cap`` rises
  linearly from ``min_length + 100`` to ``max_length`` over the first ``curriculum`` fraction of the
  steps: short sequences are cheap and teach the retrieval quickly; long ones teach distance;
* **optimiser**: AdamW (betas 0.9/0.95, weight decay 0.01 on matrices), linear warm-up, cosine decay
  to ``min_lr_ratio`` of the peak, gradient clipping at 1.0;
* **reproducibility**: ``torch.manual_seed(seed)`` before the model is built, a fixed thread count,
  the deterministic data stream above; two runs with the same seed and thread count give identical
  losses and weights on the same machine.

Held-out evaluation (:func:`held_out_accuracy`) uses the real :class:`runner.engine.Engine` with greedy
decoding on the tasks' own samples (``load_records`` seeds, which the training stream never uses).
"""

from __future__ import annotations

import json
import math
import random
import string
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from runner.errors import KvleagueError

SYNTH_TASKS = ("synth_math", "synth_code", "synth_agentic", "synth_longqa")
#: the long-dependency variant reported on the card and checked by the tests
LONG_OPTIONS = {"length": 520, "min_distance": 320}


@dataclass
class OrganismConfig:
    seed: int = 0
    steps: int = 2200
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup: int = 50
    weight_decay: float = 0.01
    # model
    hidden: int = 192
    layers: int = 2
    heads: int = 6
    kv_heads: int = 2
    intermediate: int = 512
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    # data
    min_length: int = 80
    max_length: int = 600
    curriculum: float = 0.3
    #: keys asked after the scored question, over at most ``extra_turns`` more user turns
    extra_questions: int = 12
    extra_turns: int = 2
    long_fraction: float = 0.4
    prompt_loss_weight: float = 0.0
    #: the first ``lookup_steps`` steps are only lookup rows (see :func:`lookup_row`); afterwards
    #: they are ``lookup_share`` of every batch
    lookup_steps: int = 600
    lookup_share: float = 0.25
    # compute
    threads: int = 1
    bf16: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise KvleagueError("train-organism: steps and batch size must be >= 1")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise KvleagueError(f"train-organism: hidden ({self.hidden}) must divide by heads ({self.heads}) and heads by kv-heads ({self.kv_heads})")
        if not 40 <= self.min_length <= self.max_length:
            raise KvleagueError(f"train-organism: need 40 <= min_length ({self.min_length}) <= max_length ({self.max_length})")


# ------------------------------------------------------------------------------------------------
# Tokens
# ------------------------------------------------------------------------------------------------


class TokenCodec:
    """Text -> ids for the training stream, rendering chat messages exactly as the tokenizer's ChatML
    template does (special tokens by name)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.im_start, self.im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
        self.pad = tokenizer.pad_token_id
        self.eos = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def message(self, role: str, content: str) -> list[int]:
        return self.encode(f"<|im_start|>{role}\n{content}<|im_end|>\n")

    def generation_prompt(self) -> list[int]:
        return self.encode("<|im_start|>assistant\n")


def render_example(codec: TokenCodec, ex: Any, extra: list[list[str]]) -> tuple[list[int], list[int]]:
    """Token ids and 0/1 answer mask of ``ex`` asked its first question, then each of ``extra``."""
    from tasks.synthetic import example_messages

    ids: list[int] = []
    mask: list[int] = []

    def add(tokens: list[int], answer: bool) -> None:
        ids.extend(tokens)
        mask.extend([int(answer)] * len(tokens))

    for msg in example_messages(ex):
        add(codec.message(msg["role"], msg["content"]), False)
    for i, keys in enumerate([ex.targets, *extra]):
        if i:
            add(codec.message("user", ex.question(keys).lstrip("\n")), False)
        add(codec.generation_prompt(), False)
        add(codec.encode(ex.answer(keys)) + [codec.im_end], True)
        add(codec.encode("\n"), False)
    return ids, mask


def _facts(rng: random.Random, n: int) -> dict[str, str]:
    """``n`` facts ``key -> value``: distinct one-letter keys (one case per row), values 0-99."""
    alphabet = string.ascii_lowercase if rng.random() < 0.5 else string.ascii_uppercase
    return {k: str(rng.randint(0, 99)) for k in rng.sample(alphabet, n)}


def lookup_row(codec: TokenCodec, rng: random.Random, max_facts: int = 16) -> tuple[list[int], list[int]]:
    """A retrieval warm-up row: a handful of ``key=value`` facts, then questions about them, each
    answered ``key=value``. The task's answers in miniature: short, so attention has few places to
    look and the gradient towards the right one is strong."""
    values = _facts(rng, rng.randint(2, max_facts))
    keys = list(values)
    sep = rng.choice((" ", "\n", ". "))
    order = keys[:]
    rng.shuffle(order)
    groups: list[list[str]] = []
    while order:
        k = rng.randint(1, 3)
        groups.append(order[:k])
        order = order[k:]
    ids = codec.message("user", sep.join(f"{k}={values[k]}" for k in keys) + "\nQ: " + " ".join(groups[0]))
    mask = [0] * len(ids)
    for t, group in enumerate(groups):
        if t:
            q = codec.message("user", "Q: " + " ".join(group))
            ids += q
            mask += [0] * len(q)
        gp = codec.generation_prompt()
        ans = codec.encode(" ".join(f"{k}={values[k]}" for k in group)) + [codec.im_end]
        nl = codec.encode("\n")
        ids += gp + ans + nl
        mask += [0] * len(gp) + [1] * len(ans) + [0] * len(nl)
    return ids, mask


def training_batch(config: OrganismConfig, step: int, codec: TokenCodec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch ``step`` of the training stream: ``input_ids [B, T]`` and two 0/1 masks ``[B, T]``:
    answer tokens, and the other real (non-padding) tokens."""
    from tasks.synthetic import make_example

    rng = random.Random(f"organism-train/{config.seed}/{step}")
    ramp = max(1, int(config.curriculum * config.steps))
    lo = config.min_length
    cap = min(config.max_length, lo + 100 + (config.max_length - lo - 100) * max(0, step - config.lookup_steps) // ramp)
    target = rng.randint(lo, max(lo, cap))
    rows: list[tuple[list[int], list[int]]] = []
    lookup_share = 1.0 if step < config.lookup_steps else config.lookup_share
    n_lookup = int(round(lookup_share * config.batch_size))
    # few facts first: with two or three places to look, attention finds the right one by chance
    # often enough for the gradient to build the look-back circuit
    max_facts = min(16, 2 + 14 * step // max(1, config.lookup_steps))
    for j in range(config.batch_size):
        if j < n_lookup:
            rows.append(lookup_row(codec, rng, max_facts))
            continue
        task = SYNTH_TASKS[(step * config.batch_size + j) % len(SYNTH_TASKS)]
        length = max(40, int(target * rng.uniform(0.9, 1.1)))
        n_first = 1 if rng.random() < 0.7 else rng.randint(2, 3)
        min_distance = int(length * rng.uniform(0.5, 0.8)) if rng.random() < config.long_fraction else 0
        try:
            ex = make_example(task, rng, length, min_distance, n_keys=n_first)
        except ValueError:
            ex = make_example(task, rng, length, 0, n_keys=n_first)
        others = [k for k in ex.facts if k not in ex.targets]
        rng.shuffle(others)
        others = others[: config.extra_questions]
        extra: list[list[str]] = []
        while others and len(extra) < config.extra_turns:
            k = rng.randint(1, max(1, len(others) if len(extra) == config.extra_turns - 1 else len(others) // 2 + 1))
            extra.append(others[:k])
            others = others[k:]
        rows.append(render_example(codec, ex, extra))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), codec.pad, dtype=torch.long)
    answer = torch.zeros((len(rows), width), dtype=torch.float32)
    other = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        m = torch.tensor(mask, dtype=torch.float32)
        answer[i, : len(ids)] = m
        other[i, : len(ids)] = 1.0 - m
    return input_ids, answer, other


# ------------------------------------------------------------------------------------------------
# Model and training
# ------------------------------------------------------------------------------------------------


def build_model(config: OrganismConfig, tokenizer: Any):
    from transformers import LlamaConfig, LlamaForCausalLM

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden,
        intermediate_size=config.intermediate,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=4096,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, im_end],
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(config.seed)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, im_end]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def lr_at(config: OrganismConfig, step: int) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _optimizer(model, config: OrganismConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.95), eps=1e-8,
    )


def masked_losses(head: torch.nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor, answer: torch.Tensor,
                  other: torch.Tensor, with_other: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token cross-entropy over the answer tokens and over the other tokens (a token's
    mask is the mask of the *predicted* token). The vocabulary projection runs only where a loss is
    taken: with the prompt unsupervised that is a few percent of the positions."""
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    target = input_ids[:, 1:].reshape(-1)
    a, o = answer[:, 1:].reshape(-1) > 0, other[:, 1:].reshape(-1) > 0

    def ce(sel: torch.Tensor) -> torch.Tensor:
        if not bool(sel.any()):
            return hidden.sum() * 0.0
        return torch.nn.functional.cross_entropy(head(h[sel]).float(), target[sel])

    return ce(a), (ce(o) if with_other else hidden.sum() * 0.0)


@dataclass
class TrainResult:
    out: Path
    steps: int
    seconds: float
    losses: list[float]
    parameters: int
    completed: bool
    tokens: int
    evaluation: dict[str, Any] = field(default_factory=dict)


def train(
    config: OrganismConfig,
    out: str | Path,
    *,
    minutes: float | None = 30.0,
    loss_png: str | Path | None = None,
    eval_samples: int = 50,
    progress: bool = True,
    on_step: Callable[[int, float, Any], None] | None = None,
) -> TrainResult:
    """Train the organism and write it to ``out`` (safetensors + tokenizer + ``training.json``, a
    loss curve PNG and the model card ``README.md``). ``minutes`` is a wall-clock guard: a run that
    reaches it stops early (``completed: false`` in ``training.json``); a completed run is a pure
    function of ``config``."""
    from runner.organism_tokenizer import organism_tokenizer

    out = Path(out)
    torch.set_num_threads(config.threads)
    tokenizer = organism_tokenizer()
    codec = TokenCodec(tokenizer)
    model = build_model(config, tokenizer)
    model.config._attn_implementation = "sdpa"
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = _optimizer(model, config)
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    completed = True
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, desc="train-organism", unit="step", dynamic_ncols=True)
    for step in range(config.steps):
        if minutes is not None and time.perf_counter() - start > minutes * 60:
            completed = False
            break
        input_ids, answer, other = training_batch(config, step, codec)
        for group in opt.param_groups:
            group["lr"] = lr_at(config, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
            hidden = model.model(input_ids=input_ids).last_hidden_state
        answer_loss, other_loss = masked_losses(model.lm_head, hidden, input_ids, answer, other, config.prompt_loss_weight > 0)
        loss = answer_loss + config.prompt_loss_weight * other_loss if config.prompt_loss_weight else answer_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = float(answer_loss.detach())
        losses.append(value)
        tokens += int(input_ids.numel())
        if on_step is not None:
            on_step(step, value, model)
        if bar is not None:
            elapsed = time.perf_counter() - start
            bar.set_postfix(loss=f"{value:.3f}", lr=f"{lr_at(config, step):.1e}", tok_s=f"{tokens / max(elapsed, 1e-9):.0f}")
            bar.update(1)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - start
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    result = TrainResult(out, len(losses), seconds, losses, n_params, completed, tokens)
    if loss_png is not None:
        save_loss_plot(losses, loss_png, title=f"organism (seed {config.seed}): answer-token loss")
    if eval_samples:
        result.evaluation = held_out_accuracy(str(out), eval_samples)
    (out / "training.json").write_text(json.dumps({
        "config": asdict(config),
        "parameters": n_params,
        "steps_done": len(losses),
        "completed": completed,
        "seconds": round(seconds, 1),
        "tokens": tokens,
        "final_loss_mean_last_50": sum(losses[-50:]) / max(1, len(losses[-50:])),
        "losses": [round(x, 5) for x in losses],
        "held_out": result.evaluation,
        "torch": torch.__version__,
    }, indent=1) + "\n")
    write_card(out, config, result, eval_samples)
    return result


def smooth(values: list[float], window: int = 25) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def save_loss_plot(losses: list[float], path: str | Path, title: str = "training loss") -> Path:
    """The loss curve (raw and a 25-step moving average, log scale) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = list(range(1, len(losses) + 1))
    ax.plot(steps, losses, color="#9ecae1", linewidth=0.8, label="per step")
    ax.plot(steps, smooth(losses), color="#08519c", linewidth=1.6, label="moving average (25)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on answer tokens (nats)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------
# Evaluation with the real engine
# ------------------------------------------------------------------------------------------------


def task_accuracy(engine: Any, task: Any, samples: list, method_name: str = "full", budget: int | None = None,
                  protocol: Any = None, params: dict | None = None) -> float:
    """Greedy accuracy of ``engine`` on ``samples`` of ``task`` under ``method_name`` at ``budget``
    (``None``: the full cache, any method)."""
    from methods.registry import build_method
    from runner.protocol import GenerationSettings

    settings = GenerationSettings(max_new_tokens=task.max_new_tokens, temperature=0.0, stop=task.stop)
    right = 0
    for sample in samples:
        prompt = task.build_prompt(sample, engine.tokenizer)
        method = build_method(method_name, params or {})
        b = budget if budget is not None else len(prompt) + task.max_new_tokens + 8
        result = engine.generate(prompt, method, b, protocol, settings)
        right += bool(task.score(sample, result.completion).correct)
    return right / len(samples) if samples else 0.0


#: what the card and ``training.json`` report: (label, task options, method, budget)
HELD_OUT_CELLS = (
    ("full, default", {}, "full", None),
    ("full, long", LONG_OPTIONS, "full", None),
    ("streaming_llm B=128, long", LONG_OPTIONS, "streaming_llm", 128),
    ("streaming_llm B=64, long", LONG_OPTIONS, "streaming_llm", 64),
    ("snapkv B=64, long", LONG_OPTIONS, "snapkv", 64),
)
#: the protocol of the budgeted cells (and of benchmarks/organism_budget_table.py by default)
EVAL_PROTOCOL = {"sink": 4, "recent": 16}


def held_out_accuracy(model_dir: str, n: int = 50, seed: int = 0) -> dict[str, dict[str, float]]:
    """``{task: {cell label: accuracy}}`` on ``n`` held-out samples per task (see :data:`HELD_OUT_CELLS`)."""
    from runner.engine import Engine
    from runner.protocol import Protocol
    from tasks.registry import build_task

    engine = Engine.load(model_dir)
    protocol = Protocol(**EVAL_PROTOCOL)
    out: dict[str, dict[str, float]] = {}
    for name in SYNTH_TASKS:
        out[name] = {}
        for label, options, method, budget in HELD_OUT_CELLS:
            task = build_task(name, options)
            samples = task.load(limit=n, seed=seed)
            out[name][label] = task_accuracy(engine, task, samples, method, budget, protocol)
    return out


def write_card(out: Path, config: OrganismConfig, result: TrainResult, n_eval: int) -> Path:
    """The model card ``README.md``: data, size, training, seed and held-out accuracies."""
    weights = out / "model.safetensors"
    size_mb = weights.stat().st_size / 2**20 if weights.exists() else 0.0
    tail = result.losses[-50:]
    lines = [
        "# kvleague organism",
        "",
        "A small Llama trained by `kvleague train-organism` on kvleague's synthetic long-dependency tasks",
        "(`synth_math`, `synth_code`, `synth_agentic`, `synth_longqa`; see `tasks/synthetic.py`). It exists so",
        "that the demo and CI measure eviction on a model whose full-cache accuracy is near 100% and whose",
        "answers need a fact stated hundreds of tokens earlier. Not a language model for anything else.",
        "",
        "## Model",
        "",
        f"- architecture: `LlamaForCausalLM`, {config.layers} layers, hidden {config.hidden}, {config.heads} query heads /"
        f" {config.kv_heads} KV heads (GQA), SwiGLU {config.intermediate}, RoPE (theta {config.rope_theta:g}), "
        f"{'tied' if config.tie_embeddings else 'untied'} embeddings",
        f"- parameters: {result.parameters:,} ({size_mb:.1f} MB float32 safetensors)",
        "- tokenizer: `runner/organism_tokenizer.py`, built offline (a fact `k=42` is one token; characters and byte",
        "  fallback for the rest; ChatML template);",
        "  generation stops at `<|im_end|>` (in `generation_config.eos_token_id`)",
        "- load: `Engine.load(\"models/organism\")` (or `AutoModelForCausalLM.from_pretrained`)",
        "",
        "## Data",
        "",
        "An endless seeded stream (batch `s` is a pure function of `(seed, s)`): the four synthetic tasks in equal",
        f"parts, prompt lengths drawn from [{config.min_length}, cap] characters where cap rises to {config.max_length}",
        f"over the first {config.curriculum:.0%} of the steps; {config.long_fraction:.0%} of the rows force the scored fact",
        f"to be 50-80% of the prompt away. After the scored answer each row asks up to {config.extra_questions} more keys of",
        f"the same context in up to {config.extra_turns} more turns. The first {config.lookup_steps} steps are only lookup rows",
        f"(2 to 16 facts, then questions about all of them; {config.lookup_share:.0%} of every later batch), which teach the",
        "lookup every answer needs. Held-out samples come from the tasks' own seeds, which the stream",
        "never uses.",
        "",
        "Loss: cross-entropy on the answer tokens (key=value and the closing `<|im_end|>`), plus"
        f" {config.prompt_loss_weight:g} x the mean cross-entropy on the other tokens.",
        "",
        "## Training",
        "",
        f"- seed {config.seed}, {result.steps} steps{'' if result.completed else ' (STOPPED EARLY at the time limit)'},"
        f" batch {config.batch_size}, {result.tokens:,} tokens (padding included)",
        f"- AdamW (betas 0.9/0.95, weight decay {config.weight_decay}), peak lr {config.lr:g}, {config.warmup} warm-up steps,"
        f" cosine to {config.min_lr_ratio:g} x peak, gradient clipping 1.0",
        f"- {config.threads} torch thread(s), CPU; wall time {result.seconds / 60:.1f} min; final loss {sum(tail) / max(1, len(tail)):.4f}"
        " (mean of the last 50 steps); loss curve: `docs/organism_loss.png`",
        f"- reproduce: `kvleague train-organism --seed {config.seed} --steps {config.steps} --threads {config.threads}`"
        " (same seed and thread count: same losses and weights, on the same torch build)",
        "",
        f"## Held-out accuracy ({n_eval} samples per task, greedy, real engine)",
        "",
        f"`long` = `{LONG_OPTIONS}` (the needed fact >= {LONG_OPTIONS['min_distance']} tokens before the end of the prompt).",
        f"Budgeted cells use sink={EVAL_PROTOCOL['sink']}, recent={EVAL_PROTOCOL['recent']}, prompt compression, eviction every step.",
        "",
    ]
    if result.evaluation:
        labels = [c[0] for c in HELD_OUT_CELLS]
        lines.append("| task | " + " | ".join(labels) + " |")
        lines.append("|---|" + "---:|" * len(labels))
        for name, cells in result.evaluation.items():
            lines.append(f"| {name} | " + " | ".join(f"{100 * cells[l]:.0f}%" for l in labels) + " |")
    else:
        lines.append("(not evaluated: run with `--eval-samples 50`)")
    lines.append("")
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path
