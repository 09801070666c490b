"""Device placement of the Estimators' workers: pure logic, checked with stand-in modules
(the real GPU paths run in tests/gpu on a machine with a GPU)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from hvd_spark import _env
from hvd_spark.estimator import devices
from hvd_spark.estimator.keras_worker import place_keras
from hvd_spark.estimator.torch_worker import training_device
from tests.fake_gpus import FakeCuda


def test_training_device_without_a_gpu_falls_back_to_the_cpu(caplog):
    no_cuda = types.SimpleNamespace(
        device=torch.device, __version__="2.x+cpu", version=types.SimpleNamespace(cuda=None),
        cuda=types.SimpleNamespace(is_available=lambda: False))
    assert training_device(False, 0, no_cuda) == torch.device("cpu")
    with caplog.at_level("INFO", logger="hvd_spark.estimator"):
        assert training_device(True, 0, no_cuda) == torch.device("cpu")  # Horovod's meaning
    assert "no CUDA device" in caplog.text and "training on the CPU" in caplog.text


class _FakeTfConfig:
    """Records what ``place_keras`` shows TensorFlow (pure logic: no GPU needed)."""

    def __init__(self, gpus: list[str]) -> None:
        self.gpus, self.visible, self.growth = gpus, None, []
        self.experimental = types.SimpleNamespace(
            set_memory_growth=lambda gpu, on: self.growth.append((gpu, on)))

    def list_physical_devices(self, kind: str) -> list[str]:
        return list(self.gpus) if kind == "GPU" else []

    def set_visible_devices(self, devices: list[str], kind: str) -> None:
        self.visible = (list(devices), kind)


def test_place_keras_shows_one_gpu_or_none():
    cfg = _FakeTfConfig(["gpu0", "gpu1"])
    place_keras(True, 3, types.SimpleNamespace(config=cfg))
    assert cfg.visible == (["gpu1"], "GPU") and cfg.growth == [("gpu1", True)]
    place_keras(False, 0, types.SimpleNamespace(config=cfg))
    assert cfg.visible == ([], "GPU")
    none = _FakeTfConfig([])
    place_keras(True, 0, types.SimpleNamespace(config=none))  # no GPU: the CPU, no error
    assert none.visible == ([], "GPU") and none.growth == []


def _fake_torch(count: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(device=torch.device, cuda=FakeCuda(range(count)), __version__="x",
                                 version=types.SimpleNamespace(cuda="12"))


@pytest.fixture
def no_index(monkeypatch):
    monkeypatch.delenv(_env.GPU_INDEX, raising=False)
    monkeypatch.setattr(devices, "_seen", None)
    return monkeypatch


def test_the_estimators_pin_the_gpu_spark_assigned(no_index):
    # Two ranks sharing the host's second GPU: local rank 2 is device 1, not device 2 % 2.
    no_index.setenv(_env.GPU_INDEX, "1")
    fake = _fake_torch(2)
    assert training_device(True, 2, fake) == torch.device("cuda", 1) and fake.cuda.current == 1
    cfg = _FakeTfConfig(["gpu0", "gpu1"])
    place_keras(True, 2, types.SimpleNamespace(config=cfg))
    assert cfg.visible == (["gpu1"], "GPU")
    assert devices._seen is True


def test_without_an_assigned_index_local_rank_picks(no_index):
    fake = _fake_torch(2)
    assert training_device(True, 3, fake) == torch.device("cuda", 1)
    no_index.setenv(_env.GPU_INDEX, "5")  # more than the rank sees (its own code hid some)
    assert training_device(True, 0, fake) == torch.device("cuda", 0)


def test_the_ranks_report_whether_they_saw_a_gpu(no_index):
    def worker(spec, payload):
        return {"model": payload, "device": str(training_device(spec, 0, _fake_torch(0)))}

    report = devices.run_reporting(worker, True, "m")
    assert report == devices.RankReport({"model": "m", "device": "cpu"}, False)
    assert devices.run_reporting(worker, False, "m").gpu_seen is None  # use_gpu=False: quiet
    results, seen = devices.unwrap([report, devices.RankReport(None, True), "plain"])
    assert results == [{"model": "m", "device": "cpu"}, None, "plain"]
    assert seen == [False, True, None]


def test_the_driver_warns_once_when_gpus_were_asked_for_and_none_was_seen():
    with pytest.warns(UserWarning) as caught:
        assert devices.warn_if_no_gpu("TorchEstimator", True, [False, False])
    assert len(caught) == 1
    text = str(caught[0].message)
    assert text.startswith("TorchEstimator(use_gpu=True): none of the 2 ranks saw a GPU")
    for name in ("spark.executor.resource.gpu.amount", "spark.task.resource.gpu.amount",
                 "discoveryScript", "use_gpu=False"):
        assert name in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning below fails the test
        assert not devices.warn_if_no_gpu("TorchEstimator", False, [False, False])  # default
        assert not devices.warn_if_no_gpu("TorchEstimator", True, [False, True])
        assert not devices.warn_if_no_gpu("TorchEstimator", True, [False, None])
        assert not devices.warn_if_no_gpu("TorchEstimator", True, [])


def test_only_an_explicit_use_gpu_counts_as_asked():
    from hvd_spark.estimator import TorchEstimator

    assert not TorchEstimator().isSet("use_gpu")  # Horovod's default: no warning
    assert TorchEstimator(use_gpu=True).isSet("use_gpu")
    assert TorchEstimator().setUseGpu(True).isSet("use_gpu")
