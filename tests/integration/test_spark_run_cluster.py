"""hvd_spark.run on local-cluster[2,1,1024]: two executor JVMs, one task slot each."""

from __future__ import annotations

import io

import pyspark  # noqa: F401 - CI installs it: never a skip

import hvd_spark  # noqa: E402


def test_two_executors_form_one_ring(spark_cluster):
    def fn():
        import numpy as np

        import hvd_spark.collectives as hvd

        hvd.init()
        total = hvd.allreduce(np.array([float(hvd.rank() + 1)]), op=hvd.ReduceOp.Sum)
        print(f"rank {hvd.rank()} of {hvd.size()}")
        return hvd.rank(), hvd.local_size(), float(total[0])

    out = io.StringIO()
    results = hvd_spark.run(fn, num_proc=2, stdout=out, start_timeout=120)
    # Both executors run on this machine, so the ranks share a host.
    assert results == [(0, 2, 3.0), (1, 2, 3.0)]
    assert "[1] rank 1 of 2" in out.getvalue().splitlines()
