"""Script entry point of ``kvleague bench`` (see :mod:`runner.bench.engine_vs_generate`)::

    python benchmarks/engine_vs_generate.py --help
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from runner.bench.engine_vs_generate import main  # noqa: E402

if __name__ == "__main__":
    main()
