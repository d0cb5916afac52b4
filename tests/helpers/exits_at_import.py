"""Exits the process when imported with ``LDPS_TEST_EXIT_AT_IMPORT`` set, by ``sys.exit(LDPS_TEST_EXIT)`` (a number
or a message; unset: ``sys.exit()``), for the fork server's exit codes. Without it (the suite's collection imports
every module) importing it does nothing."""

import os
import sys

if os.environ.get("LDPS_TEST_EXIT_AT_IMPORT"):
    value = os.environ.get("LDPS_TEST_EXIT")
    sys.exit(None if value is None else int(value) if value.isdigit() else value)
