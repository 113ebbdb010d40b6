"""`python -m cli`: the same entry point as the `stepahead` console script."""

import sys

from cli import main

sys.exit(main())
