"""`python -m stepahead.cli`: the same entry point as the `stepahead` console script."""

import sys

from stepahead.cli import main

sys.exit(main())
