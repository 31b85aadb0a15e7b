"""The acceptance table of issue 15: per procedure, number of questions n and samples per question,
the rejection rate of the test under a true null (nominal 5%) and the coverage of the 95% interval,
on simulated data with a known truth (:mod:`analysis.calibration`). The measured table is in
docs/statistics.md.

    python -m runner.bench.stats_calibration [--reps 4000] [--seed 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from kvleague.analysis import calibration

NS = (5, 10, 30, 100)
SAMPLES = (1, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reps", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = []
    for m in SAMPLES:
        for n in NS:
            rows += [
                calibration.paired(n, m, args.reps, 0.0, args.seed),
                calibration.paired(n, m, args.reps, calibration.ALTERNATIVE_SHIFT, args.seed + 1),
                calibration.accuracy(n, m, args.reps, args.seed + 2),
            ]
    rows.sort(key=lambda r: (r.procedure, r.samples, r.n))
    print(
        f"{args.reps} replicates per row; solve rates ~ Beta{calibration.SHAPE}; nominal: 5.0% rejection, 95.0% coverage"
    )
    print("| procedure | samples/question | n | rejection of the true value (%) | coverage (%) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.procedure} | {r.samples} | {r.n} | {100 * r.rejection:.1f} | {100 * r.coverage:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
