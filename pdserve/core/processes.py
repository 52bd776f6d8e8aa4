"""Child processes that end with their parent: the kernel's parent-death signal (Linux)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1


# Run as ``python -I -S -c CODE PARENT_PID ARGV...``: asks the kernel for SIGTERM when the parent
# dies, then becomes ARGV (the setting survives execve). Not a ``preexec_fn``: that forks a copy of
# the supervisor and runs Python in it, which aborts in gRPC's fork handlers once the supervisor
# has used gRPC (health checks, the demo); without one, subprocess uses vfork and runs nothing.
_EXEC_WITH_PARENT_DEATH_SIGNAL = (
    "import ctypes, os, signal, sys\n"
    f"ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, int(signal.SIGTERM))\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('pdserve up: the supervisor died before this child started')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def with_parent_death_signal(argv: Sequence[str], parent_pid: int) -> list[str]:
    """``argv`` run so that it gets SIGTERM when ``parent_pid`` dies (Linux; elsewhere ``argv``).

    The kernel ties this to the parent *thread* that started the child, so children must be
    spawned from a thread that lives as long as the supervisor.
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _EXEC_WITH_PARENT_DEATH_SIGNAL, str(parent_pid), *argv]
