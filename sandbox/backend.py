"""What every sandbox backend provides: private boxes that run commands under limits.

`sandbox.runner` is written against these two protocols only, so compile/test/benchmark logic is
shared by the process backend (bubblewrap + cgroups + rlimits + seccomp), the Docker backend
and the explicitly unsafe local backend.
"""

from __future__ import annotations

import abc
from typing import Protocol, TypeVar

from sandbox.job import ExecOutcome, Limits

_Self = TypeVar("_Self", bound="Closing")


class SandboxUnavailable(RuntimeError):
    """The host lacks an isolation primitive a backend needs; the message names it and the fix."""


class Box(Protocol):
    """One job's private work dir. Every command of the job runs in it with the work dir as cwd.
    Closing the box kills anything left and removes the dir, its mounts and its cgroups."""

    def write(self, name: str, data: bytes, executable: bool = False) -> None:
        """Create a file in the work dir (trusted side: sources, harness, inputs)."""

    def read(self, name: str, max_bytes: int = 1 << 20) -> bytes | None:
        """A file the program left in the work dir (None if absent); at most max_bytes."""

    def run(self, argv: list[str], stdin: bytes = b"", limits: Limits = Limits()) -> ExecOutcome:
        """Run argv (argv[0] resolved on PATH inside the box, or `./prog`) in the work dir."""

    def close(self) -> None: ...

    def __enter__(self) -> "Box": ...

    def __exit__(self, *exc: object) -> None: ...


class Backend(Protocol):
    name: str     # "process", "docker" or "unsafe_local"; reported in every Result

    def box(self) -> Box:
        """A fresh box. Use as a context manager."""

    def close(self) -> None:
        """Release long-lived resources (containers, slot uids)."""


class SandboxError(RuntimeError):
    """The sandbox machinery itself failed while running a command (not the program): the
    runner reports it as `sandbox_error`."""


class Closing(abc.ABC):
    """Base of the backends and boxes: leaving a `with` block closes them."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what this holds; closing twice does nothing."""

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
