"""Live training progress on the driver: the ranks' lines as they come, and in a Jupyter
notebook also a progress bar that updates in place."""

from __future__ import annotations

import re
import sys
from typing import IO, Any

_EPOCH = re.compile(r"^\[0\] epoch (\d+)/(\d+): (.*)$")
_WIDTH = 30


def in_notebook() -> bool:
    """True inside a Jupyter kernel (not a plain IPython terminal)."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return type(shell).__name__ == "ZMQInteractiveShell"


def render(epoch: int, epochs: int, metrics: str) -> str:
    """``[#########.....] 3/8 epochs  loss=...``."""
    done = int(_WIDTH * epoch / max(epochs, 1))
    return f"[{'#' * done}{'.' * (_WIDTH - done)}] {epoch}/{epochs} epochs  {metrics}"


class NotebookProgress:
    """A text stream for ``hvd_spark.run(stdout=...)``: passes every line through and
    redraws one progress bar (an in-place display) from rank 0's epoch lines.

    Args:
        epochs: Total epochs of the fit.
        passthrough: Where the lines go (the cell's output).
    """

    def __init__(self, epochs: int, passthrough: IO[str] | None = None) -> None:
        from IPython.display import display

        self._out = passthrough or sys.stdout
        self._handle: Any = display(render(0, epochs, "starting"), display_id=True)
        self.last = ""

    def write(self, text: str) -> int:
        for line in text.splitlines():
            match = _EPOCH.match(line)
            if match:
                self.last = render(int(match.group(1)), int(match.group(2)), match.group(3))
                self._handle.update(self.last)
        self._out.write(text)
        return len(text)

    def flush(self) -> None:
        self._out.flush()
