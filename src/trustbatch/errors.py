"""The one exception type for bad user input, and how a ``trustbatch`` process ends on it or on Ctrl-C.

``exit_on_error`` is the guard of the ``trustbatch`` command (``cli.main``) and of a lab run's forked process
(``lab.launch``), so both end the same way: one line on stderr and exit code 2 for bad input, 130 for Ctrl-C or
SIGTERM.
"""

from __future__ import annotations

import sys
from typing import Callable


class UserError(ValueError):
    """Bad input from the user: a config key, a value, a path, a name. The message names cause and fix."""


def exit_on_error(main: Callable[[], object]) -> None:
    """Run ``main()``; a ``UserError`` ends the process with one line and exit 2, a Ctrl-C with one line and 130.

    The Ctrl-C may arrive bare or chained inside a ``SystemExit`` (typer turns KeyboardInterrupt into a silent
    exit 130); any other exception, and a ``SystemExit`` without one, propagates unchanged.
    """
    try:
        main()
    except UserError as e:
        print(f"trustbatch: error: {e}", file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, SystemExit) as e:
        # typer turns KeyboardInterrupt into a silent exit 130: find it in the chain to say its message
        ki = e
        while ki is not None and not isinstance(ki, KeyboardInterrupt):
            ki = ki.__cause__ or ki.__context__
        if ki is None:
            raise
        # an exception instance is always truthy: test its message, or a bare Ctrl-C prints "trustbatch: " alone.
        # What to do next is the interrupted command's to say (train and lab run raise with it); the fallback
        # covers commands that keep nothing (report, preflight, eval) and a Ctrl-C before or between those
        print(f"trustbatch: {str(ki) or 'interrupted'}", file=sys.stderr)
        sys.exit(130)
