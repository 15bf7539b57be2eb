"""`python -m tokenmill`: the same entry point as the `tokenmill` script."""

import sys

from tokenmill.cli import main

sys.exit(main())
