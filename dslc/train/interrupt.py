"""Ctrl-C during training: finish the step under way, save, and say how to resume.

A step donates its parameters and optimizer state to the computation; interrupting it part
way would leave neither the old state nor the new one to save. So the first Ctrl-C only asks
the loop to stop after the step under way (and its checkpoint); a second one stops at once,
as Python normally does, without saving: the loop then says which checkpoint the run can
resume from and removes the one it may have been writing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any


class StopRequest:
    """Inside, Ctrl-C sets `requested` (and calls `notice` once) instead of raising."""

    def __init__(self, notice: Callable[[], None]) -> None:
        self.requested = False
        self._notice = notice
        self._previous: Any = None

    def __enter__(self) -> StopRequest:
        # Signal handlers belong to the main thread; elsewhere (a test's thread) Ctrl-C is
        # not ours to catch.
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._notice()
