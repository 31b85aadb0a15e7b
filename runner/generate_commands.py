"""``kvleague make-tiny-model``, ``kvleague methods`` and ``kvleague generate``: make a model, list the
methods, generate one completion under a KV budget."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kvleague.engine.errors import KvleagueError
from kvleague.runner.budget_reach import never_binds
from kvleague.runner.cli_args import add_protocol_arguments, parse_assignment, protocol_from_args


def cmd_make_tiny_model(args) -> int:
    from kvleague.runner.models.tiny import make_tiny_model

    out = make_tiny_model(
        args.arch,
        args.out,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        seed=args.seed,
    )
    print(out)
    return 0


def cmd_methods(args) -> int:
    from kvleague.methods.registry import available_methods, describe

    described = [describe(cls) for cls in available_methods().values()]
    presses = kvpress_presses()
    if args.json:
        print(json.dumps(described + presses, indent=2, default=str))
        return 0
    for d in described + presses:
        if "refused" in d:
            print(f"{d['name']:<16} refused: {d['refused'].split(': ', 1)[1]}")
            continue
        params = ", ".join(f"{p['name']}: {p['type']} = {p['default']!r}" for p in d["hyperparameters"]) or "-"
        needs = ", ".join(k for k, v in d["needs"].items() if v and k != "attention_window") or "cache only"
        print(f"{d['name']:<16} {d['summary']}\n{'':<16} params: {params}\n{'':<16} needs: {needs}")
    return 0


def kvpress_presses() -> list[dict]:
    """kvpress's presses as ``kvpress:<Press>`` methods (and the refused ones, with why) where kvpress is
    installed; else one line saying how to get them."""
    import importlib.util

    if importlib.util.find_spec("kvpress") is None:
        return [{"name": "kvpress:<Press>", "refused": "kvpress:<Press>: pip install 'kvleague[kvpress]'"}]
    from kvleague.methods.kvpress_bridge import catalogue

    return catalogue()


def prompt_text(args) -> str:
    """The prompt from ``--prompt TEXT`` or ``--prompt-file FILE`` (exactly one; not blank)."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise KvleagueError("generate: give one of --prompt TEXT or --prompt-file FILE")
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KvleagueError(
                f"--prompt-file: cannot read {args.prompt_file!r} as UTF-8 text: {exc.__class__.__name__}"
            ) from None
        flag = "--prompt-file"
    else:
        text, flag = args.prompt, "--prompt"
    if not text.strip():
        raise KvleagueError(f"{flag}: the prompt is empty; give the text the model should continue")
    return text


def check_context(n_prompt: int, max_new_tokens: int, context: int | None, positions: str) -> str | None:
    """A one-line error when the prompt and the tokens to generate do not fit the model's context
    (``max_position_embeddings``) under true positions; under compact positions (position = cache
    length, never above the budget) the run is possible, and the returned line warns about it."""
    if not context or n_prompt + max_new_tokens <= context:
        return None
    what = (
        f"the prompt is {n_prompt:,} tokens and --max-new-tokens {max_new_tokens:,}, past the model's context of "
        f"{context:,} tokens (max_position_embeddings)"
    )
    if positions == "compact":
        return f"warning: {what}; positions are compact, so no position exceeds the budget, but the model never saw such a text"
    raise KvleagueError(f"--prompt: {what}; shorten the prompt or --max-new-tokens")


class TextStream:
    """Writes a completion to ``out`` as its tokens are chosen (``Session.decode``'s ``on_token``): the
    tokens so far are decoded and what is new is written, less what may still change: an incomplete
    UTF-8 character at the end, and as many characters as the longest stop string has (the completion
    ends before the first stop string, which the token just chosen may complete)."""

    def __init__(self, tokenizer, stop: tuple[str, ...], out):
        self.tokenizer, self.out = tokenizer, out
        self.hold = max((len(s) for s in stop), default=0)
        self.tokens: list[int] = []
        self.written = ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True).rstrip("\ufffd")
        text = text[: len(text) - self.hold]
        if len(text) > len(self.written) and text.startswith(self.written):
            self.out.write(text[len(self.written) :])
            self.out.flush()
            self.written = text

    def finish(self, completion: str) -> None:
        """The rest of the completion and a newline. A tokenizer whose text for the first tokens is not
        a prefix of the whole text's (space clean-up) gets the completion again, whole, on a new line."""
        if completion.startswith(self.written):
            self.out.write(completion[len(self.written) :] + "\n")
        else:
            self.out.write("\n" + completion + "\n")
        self.out.flush()


def _progress(message: str) -> None:
    print(f"kvleague generate: {message}", file=sys.stderr, flush=True)


def cmd_generate(args) -> int:
    from kvleague.engine.protocol import GenerationSettings
    from kvleague.methods.registry import build_method
    from kvleague.runner.models import load_engine

    text = prompt_text(args)
    method = build_method(args.method, dict(parse_assignment(p, "--param") for p in args.param))
    protocol = protocol_from_args(args)
    protocol.check_budget(args.budget)
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, stop=tuple(args.stop)
    )
    engine = load_engine(args.model, attn_implementation=args.attn_implementation, dtype=args.dtype, device=args.device)
    tok = engine.tokenizer
    if args.chat == "on" and not getattr(tok, "chat_template", None):
        raise KvleagueError("--chat: on, but the model's tokenizer has no chat template; allowed here: auto, off")
    if args.chat != "off" and getattr(tok, "chat_template", None):
        # instruct models answer a bare prompt with an empty completion: send it as a user turn
        out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        prompt = list(out["input_ids"] if hasattr(out, "keys") else out)
    else:
        prompt = list(tok(text, add_special_tokens=False)["input_ids"])
    warning = check_context(len(prompt), args.max_new_tokens, engine.backend.max_positions, protocol.positions)
    if warning:
        _progress(warning)
    protocol, budget = protocol.for_prompt(args.budget, len(prompt))  # --budget-base prompt: room on top of it
    unbound = never_binds(budget, len(prompt), args.max_new_tokens, engine.backend.max_positions, protocol.positions)
    if unbound:
        _progress(f"warning: {unbound}")
    start = time.perf_counter()
    with engine.session(method, budget, protocol, args.seed) as session:
        if not args.json:
            _progress(f"prefill of {len(prompt):,} prompt tokens under budget {budget:,}")
        session.feed(prompt)
        if not args.json:
            _progress(
                f"prefill done in {time.perf_counter() - start:.1f}s; decoding up to {args.max_new_tokens:,} tokens"
            )
        # the completion streams to stdout as it is decoded; --json prints only the result, at the end
        stream = None if args.json else TextStream(tok, settings.stop, sys.stdout)
        session.decode(settings, on_token=stream)
        result = session.result()
    if args.json:
        print(json.dumps({**result.to_dict(), "budget_never_binds": unbound}))
        return 0
    assert stream is not None  # not --json
    stream.finish(result.completion)
    print("---", file=sys.stderr)
    for key, value in result.to_dict().items():
        if key not in ("completion", "token_ids", "kept_positions"):
            print(f"{key}: {value}", file=sys.stderr)
    return 0


def register(sub) -> None:
    p = sub.add_parser("make-tiny-model", help="write a random-weight checkpoint with an offline tokenizer")
    p.add_argument("--arch", required=True, choices=["llama", "qwen2", "qwen3"])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("methods", help="list registered eviction methods")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser("generate", help="generate one completion under a KV budget")
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="known name (default smollm2-135m), .gguf file, checkpoint directory or HF id",
    )
    p.add_argument("--method", required=True)
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="method hyperparameter")
    p.add_argument("--budget", type=int, required=True)
    p.add_argument("--prompt", default=None, help="the text to complete (or --prompt-file)")
    p.add_argument("--prompt-file", default=None, metavar="FILE", help="read the prompt from a UTF-8 text file")
    p.add_argument(
        "--chat",
        default="auto",
        choices=["auto", "on", "off"],
        help="wrap the prompt as one user turn in the tokenizer's chat template (auto: when it has one)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--seed", type=int, default=0)
    add_protocol_arguments(p)
    p.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_generate)
