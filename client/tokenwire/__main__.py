"""``python -m tokenwire``: the same as the ``tokenwire`` command."""

import sys

from tokenwire.cli import main

sys.exit(main())
