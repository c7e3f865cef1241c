"""Old names of ``ftis-client``'s exit codes, kept for :mod:`ftis.lab.attack.runner`.

The table is :class:`ftis.protocol.exit_codes.ExitCode` (docs/exit-codes.md); new code
uses it directly. These aliases carry the new numbers (the client's codes moved to
50-79 when the three programs got one table).
"""

from ftis.protocol.exit_codes import ExitCode

OK = ExitCode.OK
UNEXPECTED = ExitCode.UNEXPECTED
USAGE = ExitCode.USAGE
COORDINATOR_UNREACHABLE = ExitCode.CLIENT_COORDINATOR_UNREACHABLE
MODEL_NOT_FOUND = ExitCode.CLIENT_MODEL_NOT_FOUND
REJECTED = ExitCode.CLIENT_REJECTED
MEMORY_BUDGET = ExitCode.CLIENT_MEMORY_BUDGET
INTERRUPTED = ExitCode.INTERRUPTED
