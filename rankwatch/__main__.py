"""`python -m rankwatch …` runs the command line (for hosts without the `rankwatch` script)."""

import sys

from rankwatch.cli import main

sys.exit(main())
