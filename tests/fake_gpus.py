"""Stand-ins for GPUs on machines without one: Spark's discovery script and torch.cuda.

Spark executors cannot import ``tests``: a test that ships ``FakeCuda`` to them registers
this module with ``cloudpickle.register_pickle_by_value`` first.
"""

from __future__ import annotations

import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# What a worker's GPU discovery script prints: two GPUs, addresses 0 and 1.
DISCOVERY_SCRIPT = "#!/bin/sh\necho '{\"name\": \"gpu\", \"addresses\": [\"0\", \"1\"]}'\n"


def write_script(path: Path, text: str = DISCOVERY_SCRIPT) -> str:
    """Write an executable script (by default the discovery script); return its path."""
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


class FakeCuda:
    """torch.cuda over ``devices``: device i is ``devices[i]``, and ``set_device`` refuses
    an index CUDA would refuse; ``current`` is the device last set."""

    def __init__(self, devices: Sequence[Any]) -> None:
        self.devices, self.current = list(devices), None

    def is_available(self) -> bool:
        return bool(self.devices)

    def device_count(self) -> int:
        return len(self.devices)

    def set_device(self, index: int) -> None:
        if not 0 <= index < len(self.devices):
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self.current = self.devices[index]
