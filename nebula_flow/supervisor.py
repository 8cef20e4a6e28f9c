"""When a deployment's child that died is started again, and when it is given up.

Pure policy (no processes, no clock): ``nebula_flow.deploy.Deployment.supervise`` asks it about
each death and carries out the answer. A worker that keeps dying is given up after a few tries
so the rest keep serving; a child refused for its configuration is never retried.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

# A worker exits with this code when the broker refused to register it (wrong role for the mode,
# a bad endpoint, ...): starting it again cannot help.
REFUSED_EXIT = 2


@dataclass
class RestartPolicy:
    max_restarts: int = 5  # restarts within window_s; the next death gives the child up
    window_s: float = 300.0  # a child that ran this long since a restart has that restart forgiven
    backoff_s: float = 1.0  # delay before the first restart; doubles with each recent one
    max_backoff_s: float = 30.0

    def check(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("max_restarts must be >= 0 (0: never restart), window_s > 0, and "
                             "0 <= backoff_s <= max_backoff_s")

    def delay(self, recent: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** recent)


@dataclass
class Verdict:
    """What to do about one death: restart after ``delay_s``, or give up (``delay_s`` None)."""

    delay_s: float | None
    reason: str


@dataclass
class ChildRecord:
    """One child's restarts (times on the supervisor's clock)."""

    restarts: list[float] = field(default_factory=list)
    given_up: bool = False

    def recent(self, now: float, window_s: float) -> int:
        return sum(1 for t in self.restarts if now - t < window_s)


def judge(policy: RestartPolicy, record: ChildRecord, exit_code: int | None, now: float) -> Verdict:
    """A child just exited with ``exit_code`` (negative: killed by that signal)."""
    if exit_code == REFUSED_EXIT:
        return Verdict(None, "it was refused for its configuration (see its log); restarting cannot help")
    recent = record.recent(now, policy.window_s)
    if recent >= policy.max_restarts:
        return Verdict(None, f"it died {recent + 1} times within {policy.window_s:.0f} s (crash loop)")
    delay = policy.delay(recent)
    return Verdict(delay, f"restart {recent + 1} of {policy.max_restarts} within {policy.window_s:.0f} s")


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
