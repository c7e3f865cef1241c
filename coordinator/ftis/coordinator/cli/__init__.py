"""``ftis-coordinator`` command line."""
