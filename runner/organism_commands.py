"""``kvleague train-organism`` (added to the CLI through ``_COMMAND_MODULES``)."""

from __future__ import annotations

import dataclasses


def cmd_train_organism(args) -> int:
    from runner.organism import OrganismConfig, train

    config = OrganismConfig(
        seed=args.seed,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        threads=args.threads,
    )
    result = train(
        config,
        args.out,
        minutes=args.minutes,
        loss_png=args.loss_png or f"{args.out}/loss.png",
        eval_samples=args.eval_samples,
        progress=not args.no_progress,
    )
    state = "completed" if result.completed else f"stopped at the {args.minutes}-minute limit (NOT the reference run)"
    tail = result.losses[-50:]
    print(f"{result.out}: {result.parameters:,} parameters, {result.steps} steps {state} in {result.seconds / 60:.1f} min, "
          f"final loss {sum(tail) / max(1, len(tail)):.4f} (mean of the last {len(tail)} steps)")
    for task, cells in result.evaluation.items():
        print(f"  {task}: " + ", ".join(f"{label} {acc:.0%}" for label, acc in cells.items()))
    return 0


def register(subparsers) -> None:
    from runner.organism import OrganismConfig

    d = {f.name: f.default for f in dataclasses.fields(OrganismConfig)}
    p = subparsers.add_parser(
        "train-organism",
        help="train the small Llama on the synthetic long-dependency tasks (CPU, minutes)",
        description="Train the organism (models/organism) from a seed: same seed and thread count, same weights.",
    )
    p.add_argument("--out", default="models/organism", help="checkpoint directory (default: models/organism)")
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--minutes", type=float, default=30.0,
                   help="wall-clock guard: stop early (and say so) past this many minutes (default 30)")
    p.add_argument("--steps", type=int, default=d["steps"])
    p.add_argument("--batch-size", type=int, default=d["batch_size"])
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--hidden", type=int, default=d["hidden"])
    p.add_argument("--layers", type=int, default=d["layers"])
    p.add_argument("--heads", type=int, default=d["heads"])
    p.add_argument("--kv-heads", type=int, default=d["kv_heads"])
    p.add_argument("--intermediate", type=int, default=d["intermediate"])
    p.add_argument("--threads", type=int, default=d["threads"], help="torch threads (results depend on it)")
    p.add_argument("--loss-png", default=None, help="loss curve PNG (default: OUT/loss.png)")
    p.add_argument("--eval-samples", type=int, default=50, help="held-out samples per task after training (0: skip)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_organism)
