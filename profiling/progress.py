"""Progress reports for long profiling runs and solves: logging INFO lines, or a tqdm bar.

``NodeProgress`` counts nodes as the profiler runs them and logs every tenth of the graph once
two seconds have passed (and at least every ``every_s`` seconds); with ``bar=True`` and tqdm installed it draws a bar instead.
``heartbeat`` logs "still running" lines from a background thread while a blocking call (an ILP
solve) runs.

Example:
    >>> progress = NodeProgress(total=3, label="profiling")
    >>> for _ in range(3):
    ...     progress.step()
    >>> progress.close()
    >>> with heartbeat("solving", every_s=60.0):
    ...     pass
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["NodeProgress", "heartbeat"]

log = logging.getLogger("profiling.progress")


class NodeProgress:
    """Counts ``total`` steps; logs INFO lines every tenth (once two seconds have passed) and every
    ``every_s`` seconds, or draws a tqdm bar when ``bar`` is true and tqdm is installed."""

    def __init__(self, total: int, label: str, *, bar: bool = False, every_s: float = 10.0) -> None:
        self.total = max(total, 1)
        self.label = label
        self.every_s = every_s
        self.done = 0
        self.started = self.last_log = time.perf_counter()
        self.next_fraction = 0.1
        self._bar: Any = None
        if bar:
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is optional
                log.debug("tqdm is not installed; progress goes to the log")
            else:
                self._bar = tqdm(total=total, desc=label, unit="node", leave=False)

    def step(self, n: int = 1) -> None:
        """Count ``n`` more steps done."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        crossed = self.done / self.total >= self.next_fraction and now - self.started >= 2.0
        if crossed or now - self.last_log >= self.every_s:
            while self.next_fraction <= self.done / self.total:
                self.next_fraction += 0.1
            self.last_log = now
            log.info("%s: %d/%d nodes (%.0f%%, %.1f s)", self.label, self.done, self.total,
                     100 * self.done / self.total, now - self.started)

    def close(self) -> None:
        """Close the bar, if any."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@contextlib.contextmanager
def heartbeat(message: str, every_s: float = 10.0) -> Iterator[None]:
    """Log ``message`` with the elapsed time every ``every_s`` seconds until the block ends."""
    stop = threading.Event()
    started = time.perf_counter()

    def beat() -> None:
        while not stop.wait(every_s):
            log.info("%s: still running (%.0f s)", message, time.perf_counter() - started)

    thread = threading.Thread(target=beat, name="ckpt-planner-heartbeat", daemon=True)
    log.info("%s ...", message)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        log.info("%s: done in %.1f s", message, time.perf_counter() - started)
