"""``python -m hvd_spark.bench paths``: the allreduce paths users call, side by side.

``hvd.allreduce(x)`` (out of place: a new array) against ``hvd.allreduce_(x)`` (in place),
for float32 and the half-precision types, at each size; rounds alternate the paths and
the table gives medians, busbw (= 2(N-1)/N x bytes / time) and the out/in ratio.
``--kernels torch`` (or ``tensorflow``) runs ranks that imported that binding, whose
float16/bfloat16 reduction kernels replace numpy's.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from hvd_spark.runner.local.local_launcher import run_local

_DTYPES = ("float32", "float16", "bfloat16")


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _rank(sizes: list[int], dtypes: list[str], rounds: int, budget: int,
          kernels: str = "numpy", op_name: str = "sum") -> dict:
    import time

    import ml_dtypes
    import numpy as np

    import hvd_spark.collectives as hvd
    from hvd_spark.collectives import ops

    if kernels == "torch":
        import hvd_spark.torch

        hvd_spark.torch.init()  # lends torch's half-precision kernels
    elif kernels == "tensorflow":
        import tensorflow as tf

        import hvd_spark.tensorflow

        hvd_spark.tensorflow.init()  # lends TensorFlow's (large arrays)
        tf.constant(0.0).numpy()  # a TensorFlow job has started the runtime by then
    else:
        ops.register_half_kernels(None)
    hvd.init()
    op = hvd.Average if op_name == "average" else hvd.Sum
    out: dict = {"kernels": ops.half_kernels_name()}
    for dtype_name in dtypes:
        dtype = np.dtype(ml_dtypes.bfloat16 if dtype_name == "bfloat16" else dtype_name)
        for nbytes in sizes:
            # Zeros: repeated in-place sums of ones overflow (numpy warns on every rank).
            x = np.zeros(nbytes // dtype.itemsize, dtype)
            iters = max(2, min(50, budget // nbytes))
            paths = {"in": lambda x=x: hvd.allreduce_(x, op=op, name="b"),
                     "out": lambda x=x: hvd.allreduce(x, op=op, name="b")}
            times: dict[str, list[float]] = {"in": [], "out": []}
            for path in paths.values():
                path()  # warm-up
            for _ in range(rounds):
                for key, path in paths.items():
                    hvd.barrier()
                    start = time.perf_counter()
                    for _ in range(iters):
                        path()
                    times[key].append((time.perf_counter() - start) / iters)
            out[(dtype_name, nbytes)] = {k: statistics.median(v) for k, v in times.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    """Run on local ranks and print the table."""
    parser = argparse.ArgumentParser(prog="python -m hvd_spark.bench paths",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("-np", "--num-proc", type=int, default=2)
    parser.add_argument("--sizes", default="1M,64M", help="comma list (default 1M,64M)")
    parser.add_argument("--dtypes", default="float32", help=f"comma list of {_DTYPES}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kernels", choices=("numpy", "torch", "tensorflow"), default="numpy",
                        help="float16/bfloat16 reduction kernels (torch: ranks import "
                        "hvd_spark.torch)")
    parser.add_argument("--op", choices=("sum", "average"), default="sum",
                        help="reduction (average: what gradient averaging calls)")
    parser.add_argument("--budget-mb", type=int, default=512, help="bytes per round and size")
    args = parser.parse_args(argv)
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    bad = [d for d in dtypes if d not in _DTYPES]
    if bad:
        parser.error(f"unknown dtypes {bad}; choose from {_DTYPES}")
    n = args.num_proc
    result = run_local(_rank, args=(sizes, dtypes, args.rounds, args.budget_mb << 20,
                                    args.kernels, args.op), num_proc=n)[0]
    kernels = result.pop("kernels")
    factor = 2 * (n - 1) / n
    print(f"{n} ranks, op {args.op}, medians of {args.rounds} alternating rounds, "
          f"half kernels: {kernels}")
    print("| dtype | size | in place (ms) | busbw GB/s | out of place (ms) | busbw GB/s | "
          "out/in |\n|---|---|---|---|---|---|---|")
    for (dtype, nbytes), t in result.items():
        bw = {k: factor * nbytes / v / 1e9 for k, v in t.items()}
        print(f"| {dtype} | {nbytes >> 10} KB | {t['in'] * 1e3:.2f} | {bw['in']:.2f} | "
              f"{t['out'] * 1e3:.2f} | {bw['out']:.2f} | {bw['out'] / bw['in']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
