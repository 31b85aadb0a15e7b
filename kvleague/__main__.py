"""``python -m kvleague``: the command line."""

import sys

from kvleague.cli import main

sys.exit(main())
