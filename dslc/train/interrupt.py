"""Ctrl-C and preemption during training: finish the step under way, save, and say how to resume.

A step donates its parameters and optimizer state to the computation; interrupting it part
way would leave neither the old state nor the new one to save. So the first Ctrl-C (SIGINT)
or SIGTERM — what Slurm, Kubernetes and every cloud send a job they preempt, before a
SIGKILL after a grace period — only asks the loop to stop after the step under way (and its
checkpoint); a second one stops at once, as Python normally does, without saving: the loop
then says which checkpoint the run can resume from and removes the one it may have been
writing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

# The signals that ask a run to stop, and what each is called when the run says so.
SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class StopRequest:
    """Inside, Ctrl-C or SIGTERM sets `requested` to the signal's number (and calls `notice`
    with its name, once) instead of raising; a second one raises KeyboardInterrupt."""

    def __init__(self, notice: Callable[[str], None]) -> None:
        self.requested = 0
        self._notice = notice
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        # Signal handlers belong to the main thread; elsewhere (a test's thread) a signal is
        # not ours to catch.
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._handle) for number in SIGNALS}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = signum
        self._notice(SIGNALS[signal.Signals(signum)])
