"""``python -m hermes_core``: the ``hermes-sessions`` command line."""

from __future__ import annotations

import sys

from hermes_core.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
