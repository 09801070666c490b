"""torch's vectorised CPU kernels for float16/bfloat16 reductions, lent to the collectives.

numpy converts float16 element by element (~2-3 ns each way); torch's CPU kernels
upcast to float32, compute and round to nearest even once, vectorised, which is what
``hvd_spark.collectives.ops`` computes too, so results stay bitwise the same. The
binding's ``init()`` registers them once (:func:`register_once`); importing registers
nothing; :func:`unregister` goes back to numpy.
"""

from __future__ import annotations

import numpy as np
import torch

from hvd_spark.collectives import ops

_TORCH_DTYPES = {np.dtype(np.float16): torch.float16, ops.BFLOAT16: torch.bfloat16}

_OUT_OPS = {
    ops.ReduceOp.Sum: torch.add,
    ops.ReduceOp.Average: torch.add,
    ops.ReduceOp.Min: torch.minimum,
    ops.ReduceOp.Max: torch.maximum,
    ops.ReduceOp.Product: torch.mul,
}


#: Elements per torch call: below torch's parallel grain (32768), so its kernels run on
#: the calling thread. The collectives reduce on one thread per rank, and ranks share a
#: host's cores; torch's intra-op pool spinning against the peer ranks was up to 10x
#: slower on 2 cores.
_SLICE = 1 << 15


def _tensor(arr: np.ndarray) -> torch.Tensor:
    # torch.from_numpy knows no bfloat16: share the bits as uint16 and relabel them.
    return torch.from_numpy(arr.view(np.uint16)).view(_TORCH_DTYPES[arr.dtype])


def reduce(dst: np.ndarray, src: np.ndarray, op: ops.ReduceOp, base: np.ndarray) -> bool:
    """``dst = op(base, src)`` with torch; False (numpy does it) for ops torch lacks here."""
    fn = _OUT_OPS.get(op)
    if fn is None or not (src.flags.writeable and base.flags.writeable):
        return False  # torch.from_numpy warns about read-only arrays
    for b, s, d in zip(_tensor(base).split(_SLICE), _tensor(src).split(_SLICE),
                       _tensor(dst).split(_SLICE)):
        fn(b, s, out=d)
    return True


def scale(arr: np.ndarray, factor: float) -> bool:
    """``arr *= float32(factor)`` with torch (it computes half-precision ops in float32)."""
    # Round the factor to float32 first as numpy does; torch's float opmath then sees it exactly.
    f32 = float(np.float32(factor))
    for part in _tensor(arr).split(_SLICE):
        part.mul_(f32)
    return True


KERNELS = ops.HalfKernels(name="torch", reduce=reduce, scale=scale)

_registered_once = False


def register() -> None:
    """Reduce and scale float16/bfloat16 with torch from now on (in this process)."""
    ops.register_half_kernels(KERNELS)


def register_once() -> None:
    """:func:`register` on this process's first call only (``hvd_spark.torch.init`` calls
    it), so that a later :func:`unregister` or ``ops.register_half_kernels`` stays."""
    global _registered_once
    if not _registered_once:
        _registered_once = True
        register()


def unregister() -> None:
    """Go back to the numpy kernels if torch's are the registered ones."""
    if ops.half_kernels_name() == KERNELS.name:
        ops.register_half_kernels(None)
