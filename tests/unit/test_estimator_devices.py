"""Device placement of the Estimators' workers: pure logic, checked with stand-in modules
(the real GPU paths run in tests/gpu on a machine with a GPU)."""

from __future__ import annotations

import types

import torch

from hvd_spark.estimator.keras_worker import place_keras
from hvd_spark.estimator.torch_worker import training_device


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
