"""``python -m weightsync.cli``: the ``weightsync`` command."""

import sys

from weightsync.cli import main

sys.exit(main())
