"""Subcommands of the ``flt`` console script."""

import os

#: The help of ``--threads`` in every command that trains or evaluates (``flt bench``
#: times thread counts of its own). On a 2-core machine shared with other jobs, torch's
#: choice (one thread per core) was many times slower than one thread: OpenMP threads
#: wait for a peer that the OS has descheduled.
THREADS_HELP = ("torch CPU threads (default: 1, or torch's choice when OMP_NUM_THREADS is set; more threads than idle "
                "cores can make a run many times slower, so ask for more only on a machine of your own)")


def default_threads() -> int | None:
    """The thread count of a command given no ``--threads``: None (torch's choice, which
    follows the environment) when ``OMP_NUM_THREADS`` is set, else 1."""
    return None if os.environ.get("OMP_NUM_THREADS") else 1
