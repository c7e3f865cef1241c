"""Exit codes of ``ftis-coordinator`` (documented in ``docs/exit-codes.md``)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit status of ``ftis-coordinator``."""

    OK = 0  #: stopped normally (including SIGINT/SIGTERM)
    UNEXPECTED = 1  #: unexpected error (traceback on stderr)
    USAGE = 2  #: bad command line, configuration file or setting
    BIND = 3  #: a listener address cannot be bound
    DATABASE = 4  #: the database cannot be reached or initialised
