"""``python -m kveval ...`` is the ``kveval`` command."""

import sys

from kveval.commands.main import main

sys.exit(main())
