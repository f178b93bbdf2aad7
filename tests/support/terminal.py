"""Standard error as a terminal, for the tests of the operator commands' progress bars (drawn only
on a terminal)."""

from __future__ import annotations

import io


class Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True
