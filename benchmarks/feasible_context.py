"""Script entry point of ``kvleague bench`` (see :mod:`runner.bench.feasible_context`)::

    python benchmarks/feasible_context.py --help
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from runner.bench.feasible_context import main  # noqa: E402

if __name__ == "__main__":
    main()
