"""When cupy or NCCL cannot be loaded, CUDA tensors are staged through host memory, and the
job says so once, naming the package. The imports are made to fail on this CPU machine:
a ``None`` entry in ``sys.modules`` (absent), or a cupy that raises when imported (broken)."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest

from hvd_spark.collectives.nccl import library, selection, streams
from hvd_spark.collectives.nccl.device import DeviceAwareCommunicator
from hvd_spark.collectives.nccl.staging import HostStagingCommunicator
from tests.contract.communicator_contract import run_parallel
from tests.contract.test_tcp_contract import make_tcp

_PROBE = textwrap.dedent("""
    import json, sys, types, warnings
    {setup}
    import hvd_spark.torch as hvd
    import torch
    from hvd_spark.collectives import device_ops
    from hvd_spark.torch import device_path

    hvd.init()
    cuda_tensor = types.SimpleNamespace(is_cuda=True, dtype=torch.float32,
                                        is_contiguous=lambda: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # so that only our own once-guard can hold a repeat
        usable = [device_path.usable([cuda_tensor]) for _ in range(3)]
        enabled = device_ops.enabled()
        total = hvd.allreduce(torch.ones(3), op=hvd.Sum)  # the host path serves the job
    hvd.shutdown()
    print(json.dumps({{"usable": usable, "enabled": enabled, "sum": total.tolist(),
                      "warnings": [str(w.message) for w in caught]}}))
""")


def _probe(setup: str, extra_path: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVD_SPARK_", "HOROVOD_"))}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(setup=setup)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_without_cupy_cuda_tensors_are_staged_with_one_warning():
    got = _probe('sys.modules["cupy"] = None  # as if cupy were not installed')
    assert got["usable"] == [False, False, False] and got["enabled"] is False
    assert got["sum"] == [1.0, 1.0, 1.0]
    assert len(got["warnings"]) == 1, got["warnings"]
    text = got["warnings"][0]
    assert "staged through host memory" in text and "cupy is not installed" in text
    assert "cupy-cuda12x" in text and "HVD_SPARK_GPU_BACKEND=host" in text


def test_a_cupy_that_fails_to_load_is_staged_with_one_warning(tmp_path):
    broken = tmp_path / "cupy"
    broken.mkdir()
    (broken / "__init__.py").write_text(
        'raise ImportError("libcudart.so.12: cannot open shared object file")\n')
    got = _probe("", extra_path=str(tmp_path))
    assert got["usable"] == [False, False, False] and got["sum"] == [1.0, 1.0, 1.0]
    assert len(got["warnings"]) == 1, got["warnings"]
    assert "cupy cannot be loaded (ImportError: libcudart.so.12" in got["warnings"][0]


def test_asking_for_host_staging_is_quiet():
    got = _probe('import os; os.environ["HVD_SPARK_GPU_BACKEND"] = "host"\n'
                 'sys.modules["cupy"] = None')
    assert got["usable"] == [False, False, False] and got["warnings"] == []


class _Device:
    def __init__(self, device_id: int) -> None:
        self.id = device_id

    def use(self) -> None:
        pass

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture
def cupy_without_nccl(monkeypatch):
    """A stand-in cupy whose NCCL import fails as it does where libnccl is missing."""
    cupy = types.ModuleType("cupy")
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    cupy.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(deviceGetPCIBusId=lambda i: f"0000:0{i}:00.0"),
        Device=_Device, Stream=lambda non_blocking: types.SimpleNamespace(use=lambda: None))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", None)
    monkeypatch.setattr(streams, "_streams", {})
    monkeypatch.setattr(library, "_warned", False)
    for cached in (library.cupy, library.nccl, library.cupy_problem):
        cached.cache_clear()
    yield
    for cached in (library.cupy, library.nccl, library.cupy_problem):
        cached.cache_clear()


def test_without_nccl_two_gpus_stage_through_the_host_with_one_warning(cupy_without_nccl):
    assert library.nccl_version() == 0 and "NCCL cannot be loaded" in library.nccl_problem()
    comms = make_tcp(2, use_shm=False)
    try:
        routed = [DeviceAwareCommunicator(c, "h", selection.AUTO) for c in comms]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            paths = run_parallel(comms, lambda c: routed[c.rank].device_path(c.rank))
    finally:
        for c in comms:
            c.close()
    assert all(isinstance(p, HostStagingCommunicator) for p in paths)
    assert [r.plan.mode for r in routed] == ["host", "host"]
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1, texts
    assert "NCCL cannot be loaded on rank(s) [0, 1]" in texts[0]
    assert "nvidia-nccl-cu12" in texts[0] and "staged through host memory" in texts[0]
