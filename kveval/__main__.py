"""``python -m kveval ...`` is the ``kveval`` command."""

import sys

from kveval.cli import main

sys.exit(main())
