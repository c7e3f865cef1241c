"""Numbered exit codes of ``ftis-client`` (documented in docs/exit-codes.md)."""

OK = 0
UNEXPECTED = 1
USAGE = 2
COORDINATOR_UNREACHABLE = 3
MODEL_NOT_FOUND = 4
REJECTED = 5
MEMORY_BUDGET = 6
INTERRUPTED = 130
