"""Adasum: combine gradients by adaptive summation instead of plain averaging.

Two gradients ``a`` and ``b`` combine as

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so parallel gradients are averaged and orthogonal ones are added (Maleki et al.,
"Scaling Distributed Training with Adaptive Summation", MLSys 2021). Ranks combine
pairwise in a binary tree: (0,1), (2,3), ... then the pairs' results, and so on,
which is the order of the recursive-doubling exchange Horovod uses.

Here every rank gathers all ranks' tensors and runs the same tree in float64, so
every rank computes the bitwise-identical result. That moves ``size`` times the
data of a ring: the cost is acceptable for the sizes Adasum is used with on CPU, and
the numerics are exactly the published algorithm's.
"""

from __future__ import annotations

import numpy as np

#: Below this squared norm a vector counts as zero: its coefficient stays 1.
_TINY_NORM_SQ = 1e-8


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Adasum of two float64 vectors."""
    dot = float(np.dot(a, b))
    a_sq, b_sq = float(np.dot(a, a)), float(np.dot(b, b))
    a_coeff = 1.0 - dot / (2.0 * a_sq) if a_sq >= _TINY_NORM_SQ else 1.0
    b_coeff = 1.0 - dot / (2.0 * b_sq) if b_sq >= _TINY_NORM_SQ else 1.0
    return a_coeff * a + b_coeff * b


def tree_reduce(vectors: list[np.ndarray]) -> np.ndarray:
    """Combine the ranks' vectors (rank order) pairwise, level by level.

    With a size that is not a power of two, the odd vector out at a level moves up
    unchanged and is combined at a later level.
    """
    level = [np.asarray(v, np.float64).reshape(-1) for v in vectors]
    while len(level) > 1:
        nxt = [combine(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]
