"""What a pull from one holder costs, learned from the pulls made, and whether a pull is worth it.

A pull over the network takes about ``latency + bytes / rate``. ``LinkFit`` keeps a holder's
recent exchanges and fits the two by least squares (a round's pulls vary in size, a prompt's
dwarf them), leaving out an exchange that stalled (``_stall``: one slow pull under load halved a
fitted rate, bending the line to itself); where the sizes do not show a rate above the times' noise, the rate is taken as
unknown and a pull as its latency alone, which errs towards pulling. A pull that gave up at its
deadline is kept as what it is, a lower bound of its time, so a link that keeps failing is
learned in a few tries. Observations expire (``MEMORY_S``), so a holder
that was slow or stuck a while ago is tried again. A fit is only trusted to skip a pull up to
``EXTRAPOLATE`` times the largest exchange it has seen: a pull that is made is measured, a pull
that is skipped teaches nothing, so a doubtful prediction errs towards pulling.

Two decisions come from it (``kv/store.py``'s ``fetch_many``):

* **Pull or recompute** (``LinkFit.worth``). Recomputing a request's positions costs a forward of
  that many rows on this worker (its measured batch costs, ``elastic.estimate``). A request whose
  bytes take more than ``SKIP_FACTOR`` times that is not pulled, and an exchange is not made at
  all when its latency plus its bytes take more than ``SKIP_FACTOR`` times recomputing all it
  would bring: the positions are recomputed at once, instead of the batch waiting for a pull that
  would have lost anyway (or, past the deadline, for nothing). The factor credits the pull for
  running while the previous batch computes.
* **How long to wait.** A pull's deadline is ``DEADLINE_FACTOR`` times its prediction, at least
  ``PULL_TIMEOUT_S`` (a holder that says nothing that long is gone or stuck) and at most
  ``MAX_PULL_S`` (holders keep served rows out of reuse that long, ``kv/arena.py``). Before there
  is a fit, ``PULL_TIMEOUT_S``. A fixed 2 s failed every pull of more than 2 s of bytes (a long
  prompt's KV over a slow link) and then recomputed, after the 2 s. Where the exchanges do not
  show a rate (a round's few positions, their times all latency), they still bound it from below:
  an exchange's whole time taken as its bytes'. A pull larger than them is predicted at that
  rate, so the first prompt pull over a slow link is waited for rather than given up at 2 s
  (1 Mbit/s, measured by a few 2 kB pulls of ~9 ms: a 240 kB prompt took 2.1 s, failed).
"""

from __future__ import annotations

import threading
from collections import deque

# (pure: the simulator makes the same decision, ``sim/costs.py``)
PULL_TIMEOUT_S = 2.0  # a holder silent this long is treated as gone (a pull's deadline before its link is measured)
# The longest a pull is waited for (its link measured slow): holders keep rows they served out of
# reuse a second longer (``kv/arena.py``, ``kv/shm.py``), since a send may still be reading them.
MAX_PULL_S = 8.0
WINDOW = 32  # exchanges kept per holder
EXTRAPOLATE = 4.0  # a fit decides on pulls up to this many times its largest exchange
MEMORY_S = 60.0  # an exchange older than this is forgotten
SKIP_FACTOR = 2.0  # a pull predicted to take this many times its recompute is not made
DEADLINE_FACTOR = 3.0  # a pull is given this many times its prediction
# A finished exchange that took longer than the line through the others predicts, by more than this
# many times the exchanges' typical miss, stalled (descheduled, queued behind another send): it is
# left out of the fit, one at a time, at most a quarter of them and only among this many or more.
STALL_MISSES = 4.0
MIN_TO_TRIM = 5


class LinkFit:
    """Recent exchanges with one holder: (when, bytes, seconds, finished). Thread-safe: the prefetch
    thread pulls and learns, the compute thread reports the fit with each batch's result."""

    def __init__(self) -> None:
        self.seen: deque[tuple[float, int, float, bool]] = deque(maxlen=WINDOW)
        self.connected = False  # (the first exchange also opened the connection: TCP and CURVE handshakes)
        self.observed = 0  # exchanges kept so far: the fit is made again only when they change
        self.last: float | None = None  # when the last exchange ended (None: none yet)
        # (exchanges seen, kept) -> (the fit, the largest exchange it saw)
        self._fit: tuple[tuple[int, int], tuple[float, float | None] | None, int] = ((-1, -1), None, 0)
        self._least_rate: float | None = None  # bytes/s: the rate is at least this (made with ``_fit``)
        self.lock = threading.Lock()

    def observe(self, now: float, nbytes: int, seconds: float, finished: bool = True) -> None:
        """An exchange of ``nbytes`` took ``seconds`` (``finished`` False: it gave up then). The
        first that finished is not kept: its time is mostly the connection's setup."""
        with self.lock:
            self.last = now
            if finished and not self.connected:
                self.connected = True
            elif nbytes > 0 and seconds > 0:
                self.seen.append((now, nbytes, seconds, finished))
                self.observed += 1

    def fit(self, now: float) -> tuple[float, float | None] | None:
        """(latency s, rate bytes/s) from the exchanges of the last ``MEMORY_S``; None: none lately.
        The rate is None where the exchanges do not show it: fewer than three, or sizes whose times
        differ by no more than their noise (the line's slope within two standard errors of flat,
        as a round's pulls of a few kB over a fast link are); the latency is then their median."""
        return self._current(now)[1]

    def _current(self, now: float) -> tuple[tuple[int, int], tuple[float, float | None] | None, int]:
        with self.lock:
            while self.seen and self.seen[0][0] < now - MEMORY_S:
                self.seen.popleft()
            key = (self.observed, len(self.seen))  # (status asks with every batch's result: once per change)
            if key != self._fit[0]:
                self._fit = key, self._line() if self.seen else None, max((b for _, b, _, _ in self.seen), default=0)
                # (the slowest rate the exchanges allow: all of one's time its bytes')
                self._least_rate = max((b / t for _, b, t, done in self.seen if done), default=None)
            return self._fit

    def _line(self) -> tuple[float, float | None]:
        kept = [(b, s, done) for _, b, s, done in self.seen]
        for _ in range(len(kept) // 4 if len(kept) >= MIN_TO_TRIM else 0):
            stall = _stall(kept)
            if stall is None:
                break
            del kept[stall]
        sizes, times = [b for b, _, _ in kept], [s for _, s, _ in kept]
        line = _least_squares(sizes, times)
        if line is not None:
            slope, intercept, spread, noise = line
            if slope > 0 and slope * slope > 4 * noise / spread:
                return max(0.0, intercept), 1.0 / slope
        return sorted(times)[len(times) // 2], None

    def predict(self, nbytes: int, now: float) -> float | None:
        """Seconds a pull of ``nbytes`` should take at most; None: nothing measured lately. Where
        the rate is not known: its latency, or its bytes at the slowest rate the exchanges allow
        where that is longer (a pull larger than they were)."""
        fit = self.fit(now)
        if fit is None:
            return None
        latency, rate = fit
        if rate:
            return latency + nbytes / rate
        with self.lock:
            least = self._least_rate
        return max(latency, nbytes / least) if least else latency

    def worth(self, sizes: list[int], recompute: list[float | None], now: float) -> list[bool]:
        """Which items of one exchange to pull (``sizes``: their bytes; ``recompute``: the seconds to
        compute each here, None: not known). An item whose bytes take more than ``SKIP_FACTOR``
        times its recompute is left to compute; the others are pulled if the exchange, its latency
        paid once, is worth it for them together. An item the fit cannot judge (none lately, or
        more than ``EXTRAPOLATE`` times the largest exchange seen) or whose recompute is not known
        is pulled: that is how both get measured."""
        _, fit, largest = self._current(now)
        if fit is None:
            return [True] * len(sizes)
        latency, rate = fit
        known = [r is not None and b <= EXTRAPOLATE * largest for b, r in zip(sizes, recompute)]
        spent = [b / rate if rate else 0.0 for b in sizes]  # (each item's bytes; the latency is the exchange's)
        keep = [not k or worth_pulling(t, r) for t, r, k in zip(spent, recompute, known)]
        kept = [i for i, k in enumerate(keep) if k]
        if kept and all(known[i] for i in kept) and not worth_pulling(
                latency + sum(spent[i] for i in kept), sum(recompute[i] for i in kept)):
            return [False] * len(sizes)
        return keep

    def deadline(self, nbytes: int, now: float) -> float:
        """How long a pull of ``nbytes`` is waited for."""
        predicted = self.predict(nbytes, now)
        if predicted is None:
            return PULL_TIMEOUT_S
        return min(MAX_PULL_S, max(PULL_TIMEOUT_S, DEADLINE_FACTOR * predicted))

    def idle(self, now: float) -> bool:
        """No exchange for ``MEMORY_S``: nothing of this link is known any more."""
        return self.last is not None and self.last < now - MEMORY_S

    def state(self, now: float) -> dict[str, float | None] | None:
        """The fit as status shows it (None: nothing measured lately; ``mbit_s`` None: not shown yet)."""
        fit = self.fit(now)
        return None if fit is None else {"latency_ms": round(fit[0] * 1e3, 3),
                                         "mbit_s": round(fit[1] * 8e-6, 3) if fit[1] else None}


def _least_squares(sizes: list[int], times: list[float]) -> tuple[float, float, float, float] | None:
    """(slope, intercept, spread of the sizes, residual variance) of the line through the points;
    None: fewer than three, or one size."""
    n = len(sizes)
    mean_b, mean_s = sum(sizes) / n, sum(times) / n
    spread = sum((b - mean_b) ** 2 for b in sizes)
    if n < 3 or spread <= 0:
        return None
    slope = sum((b - mean_b) * (s - mean_s) for b, s in zip(sizes, times)) / spread
    intercept = mean_s - slope * mean_b
    return slope, intercept, spread, sum((s - intercept - slope * b) ** 2 for b, s in zip(sizes, times)) / (n - 2)


def _stall(points: list[tuple[int, float, bool]]) -> int | None:
    """The index of the exchange that stalled most, if one did: a finished exchange slower than the
    line through the others predicts (its deleted residual, so a large stalled pull cannot bend the
    line to itself) by more than ``STALL_MISSES`` times the median miss. Only slower: a stall
    only ever adds time, and a pull that gave up is what the link is, not a stall."""
    sizes, times = [b for b, _, _ in points], [s for _, s, _ in points]
    line = _least_squares(sizes, times)
    if line is None:
        return None
    slope, intercept, spread, _ = line
    n, mean_b = len(sizes), sum(sizes) / len(sizes)
    misses = []
    for b, s in zip(sizes, times):
        leverage = 1 / n + (b - mean_b) ** 2 / spread
        misses.append((s - intercept - slope * b) / max(1 - leverage, 1e-9))  # (the miss of the line without it)
    typical = 1.4826 * sorted(abs(m) for m in misses)[n // 2]  # (the median miss, as a standard deviation)
    worst = max((i for i in range(n) if points[i][2]), key=lambda i: misses[i], default=None)
    return worst if worst is not None and typical > 0 and misses[worst] > STALL_MISSES * typical else None


def worth_pulling(predicted_s: float | None, recompute_s: float | None) -> bool:
    """Whether a pull predicted to take ``predicted_s`` beats recomputing in ``recompute_s`` (either
    unknown: pull, which is how both get measured)."""
    return predicted_s is None or recompute_s is None or predicted_s <= SKIP_FACTOR * recompute_s
