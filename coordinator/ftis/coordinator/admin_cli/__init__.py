"""``ftis-admin`` command line (operator client of the admin service)."""
