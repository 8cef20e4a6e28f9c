"""What a child process of a deployment needs to know about its parent."""

from __future__ import annotations

import os

PARENT_ENV = "NEBULA_FLOW_PARENT_PID"


def orphaned() -> bool:
    """True when the process that deployed this one (``NEBULA_FLOW_PARENT_PID``) has died, so
    a broker or worker never outlives a killed ``serve`` / bench / test."""
    parent = os.environ.get(PARENT_ENV)
    return parent is not None and os.getppid() != int(parent)
