"""Reference-counted live storages and the running total of a replay
(:func:`planner.core.simulate.simulate`).

Example:
    >>> mem = MemoryAccount(0)
    >>> mem.alloc("g", 100)
    True
    >>> mem.hold("g"); mem.share("h", "g"); mem.hold("h")
    >>> mem.release("g"); mem.live_bytes      # "h" still holds the bytes
    100
    >>> mem.release("h"); mem.live_bytes
    0
"""

from __future__ import annotations

import math

__all__ = ["AboveLimit", "MemoryAccount"]


class AboveLimit(Exception):
    """Raised by :meth:`MemoryAccount.observe` at the first moment above the replay's limit."""


class MemoryAccount:
    """Reference-counted live storages and the running total.

    With ``limit_bytes`` the replay stops (:class:`AboveLimit`) at the first moment above it;
    with ``record_timeline=False`` no timeline is kept.
    """

    def __init__(self, base_bytes: int, *, limit_bytes: float = math.inf, record_timeline: bool = True) -> None:
        self.live_bytes = base_bytes
        self.refs: dict[object, int] = {}
        self.size: dict[object, int] = {}
        #: the bytes a name shares with others (:meth:`share`): held once, freed with the last name
        self.buffer_of: dict[object, object] = {}
        self.peak_bytes = base_bytes
        self.peak_at: tuple[str, str] = ("start", "")
        self.limit_bytes = limit_bytes
        self.timeline: list[tuple[str, str, int]] | None = [] if record_timeline else None

    def alloc(self, key: object, size_bytes: int) -> bool:
        if key in self.refs:
            return False
        self.refs[key] = 0
        self.size[key] = size_bytes
        self.live_bytes += size_bytes
        return True

    def hold(self, key: object) -> None:
        if key in self.refs:
            self.refs[key] += 1

    def release(self, key: object) -> None:
        if key not in self.refs:
            return
        self.refs[key] -= 1
        if self.refs[key] <= 0:
            self.free(key)

    def free_if_unheld(self, key: object) -> None:
        if key in self.refs and self.refs[key] <= 0:
            self.free(key)

    def free(self, key: object) -> None:
        del self.refs[key]
        self.live_bytes -= self.size.pop(key)
        buffer = self.buffer_of.pop(key, None)
        if buffer is not None:
            self.release(buffer)

    def share(self, key: object, existing: object) -> None:
        """Allocate ``key`` as another name for ``existing``'s bytes (one tensor, two holders):
        they are freed when every name is. ``key`` starts unheld, as after :meth:`alloc`."""
        buffer = self.buffer_of.get(existing)
        if buffer is None:
            buffer = ("shared_bytes", existing)
            self.refs[buffer] = 1
            self.size[buffer] = self.size[existing]
            self.size[existing] = 0
            self.buffer_of[existing] = buffer
        self.refs[buffer] += 1
        self.refs[key] = 0
        self.size[key] = 0
        self.buffer_of[key] = buffer

    def is_shared(self, key: object) -> bool:
        """Whether ``key``'s bytes are held by another live name too (:meth:`share`)."""
        buffer = self.buffer_of.get(key)
        return buffer is not None and self.refs.get(buffer, 0) > 1

    def unshare(self, key: object, size_bytes: int) -> None:
        """Give ``key`` bytes of its own, ``size_bytes`` new ones (an out-of-place sum into a
        shared tensor), dropping its hold on the shared ones."""
        buffer = self.buffer_of.pop(key, None)
        self.size[key] = size_bytes
        self.live_bytes += size_bytes
        if buffer is not None:
            self.release(buffer)

    def observe(self, phase: str, node: str, extra_bytes: int = 0) -> None:
        now = self.live_bytes + extra_bytes
        if self.timeline is not None:
            self.timeline.append((phase, node, now))
        if now > self.peak_bytes:
            self.peak_bytes = now
            self.peak_at = (phase, node)
            if now > self.limit_bytes:
                raise AboveLimit
