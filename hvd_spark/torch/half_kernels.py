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

# register(): torch's from now on, replacing any; register_once(): on hvd_spark.torch's
# first init(); unregister(): back to numpy.
_REGISTRATION = ops.HalfKernelRegistration(KERNELS, replace=True)
register, register_once, unregister = (_REGISTRATION.register, _REGISTRATION.register_once,
                                       _REGISTRATION.unregister)
