"""``python -m kvwise.cli``: the ``kvwise`` command (tests and scripts start a server this way)."""

import sys

from kvwise.cli import main

sys.exit(main())
