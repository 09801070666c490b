"""The device fusion buffer: several tensors of one dtype seen as one flat buffer.

NCCL (like MPI) moves one contiguous buffer per call, so a fused allreduce of many
gradients packs them into a scratch buffer kept per dtype and grown as needed, runs
one collective on it, and unpacks. Written against an array module (``xp``: cupy on
the device; numpy works the same, which is how it is tested without a GPU). Copies
run on the caller's current stream (the collective stream), so no host sync is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class FusionBuffer:
    """Per-dtype scratch buffers of module ``xp``, reused across operations.

    Args:
        xp: The array module (cupy for device buffers).
    """

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self._buffers: dict[Any, Any] = {}

    def capacity(self, dtype: Any) -> int:
        """Elements the buffer for ``dtype`` holds now (0 before first use)."""
        buf = self._buffers.get(self.xp.dtype(dtype))
        return 0 if buf is None else int(buf.size)

    def _scratch(self, dtype: Any, size: int) -> Any:
        key = self.xp.dtype(dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.size < size:
            # Grow geometrically: gradient sets vary a little from step to step.
            grown = max(size, 2 * (0 if buf is None else buf.size))
            buf = self._buffers[key] = self.xp.empty(grown, key)
        return buf

    def pack(self, pieces: Sequence[Any]) -> Any:
        """One flat array holding ``pieces`` (the piece itself when there is one)."""
        if len(pieces) == 1:
            return pieces[0]
        total = sum(int(p.size) for p in pieces)
        flat = self._scratch(pieces[0].dtype, total)[:total]
        offset = 0
        for piece in pieces:
            flat[offset : offset + piece.size] = piece
            offset += piece.size
        return flat

    def unpack(self, flat: Any, pieces: Sequence[Any]) -> None:
        """Copy ``flat`` back into ``pieces`` (nothing to do for a single piece)."""
        if len(pieces) == 1 and flat is pieces[0]:
            return
        offset = 0
        for piece in pieces:
            piece[...] = flat[offset : offset + piece.size]
            offset += piece.size

    def release(self) -> None:
        """Free the scratch buffers."""
        self._buffers.clear()
