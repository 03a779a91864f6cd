"""`dslc train --profile START:STOP`: a JAX profiler trace of those steps, in the run folder.

The trace covers steps START to STOP (counted as the run counts them, from 1), the first
compiled step only if START is it: profiling the compilation would bury the steps in it.
JAX writes it under `profile/plugins/profile/<time>/`: an XPlane file for TensorBoard's
profile plugin (`tensorboard --logdir RUN/profile`) and `perfetto_trace.json.gz`, which
ui.perfetto.dev opens as it is. Every process of a multi-process run traces its own
devices into the same folder, each file named by its host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

PROFILE_DIR = "profile"


@dataclass
class ProfileWindow:
    """Steps `start` to `stop` of a run traced into `folder`."""

    start: int
    stop: int
    folder: Path
    _tracing: bool = field(default=False, init=False)

    def before(self, step: int) -> None:
        """Step `step` is about to run."""
        if step == self.start:
            import jax

            jax.profiler.start_trace(str(self.folder), create_perfetto_trace=True)
            self._tracing = True

    def after(self, step: int) -> str | None:
        """Step `step` has finished (its results read back); what to tell the user once the
        trace is written."""
        if step == self.stop and self._tracing:
            return self.close()
        return None

    def close(self) -> str | None:
        """End a trace under way (the run stopping early included), and say where it is."""
        if not self._tracing:
            return None
        import jax

        jax.profiler.stop_trace()
        self._tracing = False
        traces = sorted(self.folder.glob("plugins/profile/*/perfetto_trace.json.gz"))
        perfetto = f"; or open {traces[-1]} in ui.perfetto.dev" if traces else ""
        return (
            f"profile of steps {self.start}-{self.stop} in {self.folder}: tensorboard --logdir {self.folder}{perfetto}"
        )


def parse_window(text: str) -> tuple[int, int]:
    """`START:STOP` (or one step, `N`) as (start, stop); ValueError with what is wrong."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"expected START:STOP, two step numbers (or one), got {text!r}")
    start, stop = int(parts[0]), int(parts[-1])
    if not 1 <= start <= stop:
        raise ValueError(f"{text}: the steps count from 1 and START must not come after STOP")
    return start, stop
