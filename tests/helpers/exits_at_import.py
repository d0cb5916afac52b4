"""Exits the process when imported, with ``sys.exit(LDPS_TEST_EXIT)`` (nothing: ``sys.exit()``), for the fork
server's exit codes."""

import os
import sys

value = os.environ.get("LDPS_TEST_EXIT")
sys.exit(None if value is None else int(value) if value.isdigit() else value)
