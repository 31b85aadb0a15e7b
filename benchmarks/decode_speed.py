"""Script entry point of ``kvleague bench`` (see :mod:`runner.bench.decode_speed`)::

    python benchmarks/decode_speed.py --help
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from runner.bench.decode_speed import main  # noqa: E402

if __name__ == "__main__":
    main()
