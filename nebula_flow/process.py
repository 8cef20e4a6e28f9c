"""What a child process of a deployment needs to know about its parent."""

from __future__ import annotations

import os

PARENT_ENV = "NEBULA_FLOW_PARENT_PID"
RESTARTS_ENV = "NEBULA_FLOW_RESTARTS"  # how many times the deployment has started this child again


def orphaned() -> bool:
    """True when the process that deployed this one (``NEBULA_FLOW_PARENT_PID``) has died, so
    a broker or worker never outlives a killed ``serve`` / bench / test."""
    parent = os.environ.get(PARENT_ENV)
    return parent is not None and os.getppid() != int(parent)


def restarts() -> int:
    """How many times this process's deployment has restarted it after a death (0: first start);
    the broker's ``status`` reports it for itself and each worker."""
    try:
        return max(0, int(os.environ.get(RESTARTS_ENV, "0")))
    except ValueError:
        return 0
