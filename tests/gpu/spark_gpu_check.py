"""Spark's GPU scheduling on real GPUs: each rank's device is the one Spark assigned, and a
TorchEstimator trains on it, with half a GPU per task (``spark.task.resource.gpu.amount=0.5``).

Run by ``tests/gpu/run_device_checks.sh`` on a machine with NVIDIA GPUs, Java and pyspark;
not a pytest module (it starts its own Spark cluster). The discovery script is Spark's own
recipe, ``nvidia-smi --query-gpu=index``. The master is ``local-cluster[1,2,...]``: Spark's
local mode never schedules tasks that ask for GPUs. Prints ``RESULT <ok|FAILED> <detail>``
last; exits 0 when every check held.
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tempfile
import time
import warnings

_DISCOVERY = """#!/bin/sh
ADDRS=$(nvidia-smi --query-gpu=index --format=csv,noheader | tr -d ' ' | paste -sd, - \\
        | sed 's/,/","/g')
echo "{\\"name\\": \\"gpu\\", \\"addresses\\": [\\"$ADDRS\\"]}"
"""


def _pci(bus_id: str) -> tuple[int, int, int]:
    """(domain, bus, device) of a PCI bus id as nvidia-smi or CUDA write it."""
    domain, bus, rest = bus_id.strip().split(":")
    return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)


def _bus_ids() -> dict[str, tuple[int, int, int]]:
    """nvidia-smi index (Spark's GPU address) -> its PCI location."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    pairs = (line.split(",") for line in out.splitlines() if line.strip())
    return {index.strip(): _pci(bus) for index, bus in pairs}


def _session(gpus: int, workdir: str):
    from pyspark.sql import SparkSession

    script = os.path.join(workdir, "discover_gpus.sh")
    with open(script, "w") as f:
        f.write(_DISCOVERY)
    os.chmod(script, os.stat(script).st_mode | stat.S_IXUSR)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return (
        SparkSession.builder.master("local-cluster[1,2,2048]")
        .appName("hvd_spark-gpu-check")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.worker.resource.gpu.amount", str(gpus))
        .config("spark.worker.resource.gpu.discoveryScript", script)
        .config("spark.executor.resource.gpu.amount", str(gpus))
        .config("spark.executor.resource.gpu.discoveryScript", script)
        .config("spark.task.resource.gpu.amount", "0.5")
        .getOrCreate()
    )


def _rank_device() -> dict:
    import os

    import torch

    import hvd_spark.torch as hvd
    from hvd_spark.task import device_index, get_available_devices

    hvd.init()
    try:
        index = device_index()
        torch.cuda.set_device(index)
        props = torch.cuda.get_device_properties(index)
        if hasattr(props, "pci_bus_id"):
            bus = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
        else:  # an older torch: ask the CUDA runtime through cupy
            import cupy

            bus = _pci(cupy.cuda.runtime.deviceGetPCIBusId(index))
        total = hvd.allreduce(torch.ones(4, device="cuda"), op=hvd.Sum)  # on that device
        return {"rank": hvd.rank(), "own": get_available_devices(), "index": index,
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "bus": tuple(bus),
                "sum": total.cpu().tolist()}
    finally:
        hvd.shutdown()


def _fit(spark, workdir: str) -> tuple[float, float]:
    import numpy as np
    import torch
    from pyspark.ml.feature import VectorAssembler

    from hvd_spark.estimator import TorchEstimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 4))
    y = (x @ np.array([1.5, -2.0, 0.75, 0.0]) > 0).astype(int)
    rows = [(*map(float, r), int(label)) for r, label in zip(x, y)]
    frame = spark.createDataFrame(rows, "a double, b double, c double, d double, label long")
    frame = VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="features").transform(frame)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    est = TorchEstimator(num_proc=2, model=model, loss=torch.nn.CrossEntropyLoss(),
                         optimizer=torch.optim.Adam(model.parameters(), lr=0.02),
                         feature_cols=["features"], label_cols=["label"], batch_size=64,
                         epochs=3, store=os.path.join(workdir, "store"), use_gpu=True, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fitted = est.fit(frame)
    no_gpu = [str(w.message) for w in caught if "saw a GPU" in str(w.message)]
    if no_gpu:
        raise AssertionError(no_gpu[0])
    losses = [epoch["train"]["loss"] for epoch in fitted.getHistory()]
    return losses[0], losses[-1]


def main() -> int:
    import hvd_spark

    buses = _bus_ids()  # what the discovery script will report
    gpus = len(buses)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvd_spark_gpu_check_") as workdir:
        spark = _session(gpus, workdir)
        try:
            ranks = hvd_spark.run(_rank_device, num_proc=2, stdout=io.StringIO())
            problems = []
            for r in ranks:
                (own,) = r["own"]
                if r["bus"] != buses[own]:
                    problems.append(f"rank {r['rank']} is on {r['bus']}, Spark gave it GPU "
                                    f"{own} ({buses[own]})")
                if r["sum"] != [2.0] * 4:
                    problems.append(f"rank {r['rank']}: allreduce gave {r['sum']}")
            first, last = _fit(spark, workdir)
            if not last < first:
                problems.append(f"the fit did not learn: loss {first:.3f} -> {last:.3f}")
        finally:
            spark.stop()
    placed = "; ".join(f"rank {r['rank']}: GPU {r['own'][0]} = cuda:{r['index']} of "
                       f"{r['visible']}" for r in ranks)
    verdict = "FAILED " + " | ".join(problems) if problems else "ok"
    print(f"RESULT {verdict} ({placed}; fit loss {first:.3f} -> {last:.3f}; "
          f"{time.monotonic() - started:.0f} s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
