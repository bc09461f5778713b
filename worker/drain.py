"""A warm shutdown, as the worker's signals ask for it. The first SIGTERM (or SIGINT) stops
the taking of shards and gives the running ones `timeout` seconds to finish; a second one
makes that now. The signal handler only sets this state: the loop acts on it between engine
steps (consumer.py), and an outage that outlasts the deadline gives the shards up
(outage.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(slots=True)
class Drain:
    timeout: float  # seconds the running shards get to finish after the first signal
    requested: bool = False
    until: float | None = None  # monotonic time the running shards are handed back; set iff requested

    def request(self) -> bool:
        """A signal: start the drain, or, at the second, end it now. Returns whether it was
        the first."""
        first = not self.requested
        self.requested = True
        self.until = time.monotonic() + self.timeout if first else 0.0
        return first

    def due(self, t: float) -> bool:
        """The drain's time is up: the running shards go back to their queues."""
        return self.until is not None and t >= self.until
