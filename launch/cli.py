"""What every command line shares: bad input ends with one `error: ...` line naming the field
and the fix (exit 2), never a traceback (the checks themselves: launch/checks.py)."""

from __future__ import annotations

import sys

from rl.config.schema import ConfigError
from sandbox.backend import SandboxUnavailable

# Problems with what the user gave (config, files, data, host), found before or while loading.
INPUT_ERRORS = (ConfigError, ValueError, FileNotFoundError, FileExistsError, SandboxUnavailable)


def fail(err: BaseException) -> None:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
