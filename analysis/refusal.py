"""The analysis commands' one-line refusals: a bad input, a damaged file or an unsafe request is said in one line
on stderr and ends the command with exit 2, as ``rpa``'s own commands do (:mod:`rpa.core.errors`).

``Refused`` is a ``SystemExit`` (so a library caller that does not catch it still stops, with the message), and
:func:`run` -- what each command's ``__main__`` calls -- turns it into the line and the exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

EXIT_REFUSED = 2
"""The exit status of a refusal (argparse's and rpa's for bad input)."""


class Refused(SystemExit):
    """An analysis command's refusal: ``str()`` is the one line said."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def run(main: Callable[[], int | None]) -> int:
    """Call a command's ``main``; a :class:`Refused`, or an rpa input error raised under it (a damaged result file:
    :class:`rpa.core.jsonfiles.DamagedFile`), prints its line to stderr and gives :data:`EXIT_REFUSED`."""
    from rpa.core.errors import UserError

    try:
        return main() or 0
    except (Refused, UserError) as refusal:
        print(str(refusal), file=sys.stderr)
        return EXIT_REFUSED
