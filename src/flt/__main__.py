"""``python -m flt``: the same entry point as the ``flt`` console script."""

import sys

from flt.cli import main

sys.exit(main())
