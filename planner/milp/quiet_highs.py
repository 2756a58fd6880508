"""Keep HiGHS's start-up banner off the process's standard output.

HiGHS 1.16 prints a copyright banner ("Running HiGHS 1.16.0 ...") to file descriptor 1 from
C++ when the first ``highspy.Highs`` object of a process is made, whatever its options say
later. PuLP makes one per solve, so the banner landed in the middle of the CLI's JSON and CSV
on standard output (``ckpt-planner report ... --format json`` was not JSON any more).
:func:`absorb_highs_banner` makes that first object itself, with descriptor 1 pointed at a
temporary file, and logs what was printed at DEBUG; later objects print nothing. It runs once
per process, before the first HiGHS solve; without highspy it does nothing.

Example:
    >>> absorb_highs_banner()  # idempotent: the second call does nothing
    >>> absorb_highs_banner()
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import tempfile

__all__ = ["absorb_highs_banner"]

log = logging.getLogger(__name__)


@functools.cache
def absorb_highs_banner() -> None:
    """Make the process's first ``highspy.Highs`` with standard output captured (once)."""
    try:
        import highspy
    except ImportError:
        return
    try:
        sys.stdout.flush()
        saved_fd = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no usable descriptor 1: nothing to protect
        highspy.Highs()
        return
    with tempfile.TemporaryFile(mode="w+b") as captured:
        try:
            os.dup2(captured.fileno(), 1)
            highspy.Highs()
        finally:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
        captured.seek(0)
        banner = captured.read().decode(errors="replace").strip()
    if banner:
        log.debug("HiGHS start-up output: %s", banner)
