"""Fit retries without Spark: which failures are retried, from which checkpoint, how often;
step checkpoints in a real local store; the parameters' checks."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from hvd_spark.data.store import Store
from hvd_spark.errors import ConfigError, WorkerFailedError
from hvd_spark.estimator import KerasEstimator, TorchEstimator
from hvd_spark.estimator.recovery import recoverable, run_with_retries
from hvd_spark.estimator.step_checkpoints import (
    ResumePoint,
    read_step_checkpoint,
    resume_point,
    save_step_checkpoint,
)
from hvd_spark.estimator.train_spec import TrainSpec
from hvd_spark.runner.backend import Backend, SparkBackend
from hvd_spark.runner.failures import WorkerFailure

LOST = WorkerFailure(1, "host-x", "executor 3 lost (Command exited with code 137)", lost=True)
DISCONNECT = WorkerFailure(0, "host-y", "PeerDisconnectedError: rank 1 disconnected",
                           secondary=True)
BUG = WorkerFailure(0, "host-y", "ValueError: bad shape", traceback="Traceback ...")


class ScriptedBackend(Backend):
    """The launcher seam: each run raises the next scripted error, then returns results."""

    def __init__(self, errors: list[BaseException], during=None) -> None:
        self.errors = list(errors)
        self.during = during  # what the failing attempt did before failing
        self.specs: list[TrainSpec] = []

    def run(self, fn, args=(), kwargs=None, env=None) -> list:
        self.specs.append(args[0])
        if self.errors:
            if self.during is not None:
                self.during()
            raise self.errors.pop(0)
        return [fn(*args)]

    def num_processes(self) -> int:
        return 2


def _spec(store: Store) -> TrainSpec:
    return TrainSpec(dataset=None, store=store, run_id="r", batch_size=4, val_batch_size=4,
                     epochs=6, start_epoch=0, shuffle=False, seed=0, train_steps=None,
                     val_steps=None, backward_passes_per_step=1, compression=None, verbose=0,
                     use_gpu=False)


def _worker(spec, payload):
    return (spec.start_epoch, spec.start_step, payload)


def test_only_losses_are_recoverable():
    assert recoverable(WorkerFailedError([LOST, DISCONNECT]))
    assert recoverable(WorkerFailedError([DISCONNECT]))  # only consequences: infrastructure
    assert not recoverable(WorkerFailedError([BUG, DISCONNECT]))
    assert not recoverable(WorkerFailedError([BUG, LOST]))
    assert not recoverable(WorkerFailedError([]))


def test_a_loss_resumes_from_the_newest_checkpoint_and_says_so(tmp_path, caplog):
    store = Store.create(str(tmp_path / "store"))
    store.save_checkpoint("r", 0, b"epoch 1")
    store.save_checkpoint("r", 1, b"epoch 2")
    # The first attempt checkpoints 4 steps of epoch 3, then loses a rank.
    backend = ScriptedBackend([WorkerFailedError([LOST, DISCONNECT])],
                              during=lambda: save_step_checkpoint(store, "r", 2, 4, b"step"))
    with caplog.at_level(logging.WARNING, logger="hvd_spark.estimator"):
        result = run_with_retries(backend, _worker, _spec(store), "payload", {}, max_retries=3)
    assert result == [(2, 4, "payload")]
    assert [(s.start_epoch, s.start_step) for s in backend.specs] == [(2, 0), (2, 4)]
    assert ("rank 1 on host host-x lost: executor 3 lost (Command exited with code 137); "
            "resuming from epoch 3, step 5 with 2 ranks (retry 1 of 3)") in caplog.messages


def test_an_exception_of_the_training_code_is_never_retried(tmp_path):
    backend = ScriptedBackend([WorkerFailedError([BUG, DISCONNECT])])
    with pytest.raises(WorkerFailedError, match="bad shape"):
        run_with_retries(backend, _worker, _spec(Store.create(str(tmp_path))), None, {}, 3)
    assert len(backend.specs) == 1


def test_retries_stop_at_max_retries_with_a_note(tmp_path):
    errors = [WorkerFailedError([LOST]) for _ in range(3)]
    backend = ScriptedBackend(errors)
    with pytest.raises(WorkerFailedError) as info:
        run_with_retries(backend, _worker, _spec(Store.create(str(tmp_path))), None, {}, 2)
    assert len(backend.specs) == 3
    assert any("retried 2 time(s) (max_retries=2)" in note for note in info.value.__notes__)


def test_step_checkpoints_keep_the_newest_and_lose_to_a_newer_epoch(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    assert resume_point(store, "r") == ResumePoint(0, 0)
    store.save_checkpoint("r", 0, b"e0")
    save_step_checkpoint(store, "r", 1, 3, b"s3")
    save_step_checkpoint(store, "r", 1, 6, b"s6")
    assert resume_point(store, "r") == ResumePoint(1, 6)
    assert resume_point(store, "r").describe() == "epoch 2, step 7"
    assert read_step_checkpoint(store, "r", ResumePoint(1, 6)) == b"s6"
    steps = [n for n in store.list_files(store.checkpoints_path("r")) if n.startswith("step-")]
    assert steps == ["step-000001-000000006.ckpt"]  # the older one is gone
    assert store.list_checkpoints("r") == [0]  # step files are not epoch checkpoints
    store.save_checkpoint("r", 1, b"e1")  # epoch 2 completed after the step checkpoint
    assert resume_point(store, "r") == ResumePoint(2, 0)
    assert ResumePoint(2).describe() == "epoch 3"


def _torch_kwargs(**overrides):
    model = torch.nn.Linear(4, 2)
    kwargs = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  loss=torch.nn.MSELoss(), feature_cols=["f"], label_cols=["y"])
    kwargs.update(overrides)
    return kwargs


def test_retry_parameters_are_checked_before_any_work():
    assert TorchEstimator(**_torch_kwargs()).getMaxRetries() == 3
    assert TorchEstimator(**_torch_kwargs()).getCheckpointEverySteps() is None
    TorchEstimator(**_torch_kwargs(max_retries=0, checkpoint_every_steps=5))._check_params()
    with pytest.raises(ConfigError, match="max_retries must be >= 0"):
        TorchEstimator(**_torch_kwargs(max_retries=-1))._check_params()
    with pytest.raises(ConfigError, match="checkpoint_every_steps must be >= 1"):
        TorchEstimator(**_torch_kwargs(checkpoint_every_steps=0))._check_params()


def test_keras_refuses_step_checkpoints_naming_the_parameter():
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    est = KerasEstimator(model=model, optimizer=keras.optimizers.SGD(0.1), loss="mse",
                         feature_cols=["f"], label_cols=["y"], checkpoint_every_steps=10)
    with pytest.raises(ConfigError, match="checkpoint_every_steps is not supported by "
                                          "KerasEstimator"):
        est._check_params()


class _Slots(SparkBackend):
    """A SparkBackend whose cluster reports the given task slots, one value per look."""

    def __init__(self, slots: list[int]) -> None:
        super().__init__(num_proc=2)
        self.slots = list(slots)

    def available_slots(self) -> int:
        return self.slots.pop(0) if len(self.slots) > 1 else self.slots[0]


def test_retry_waits_for_the_slots_to_come_back():
    backend = _Slots([1, 1, 2])
    assert backend.for_retry(2, wait_s=30).num_processes() == 2
    assert backend.slots == [2]  # it looked until the replacement executor was there


def test_retry_goes_on_with_the_slots_that_remain_after_the_deadline():
    started = time.monotonic()
    shrunk = _Slots([1]).for_retry(2, wait_s=1.5)
    assert shrunk.num_processes() == 1
    assert 1.5 <= time.monotonic() - started < 10


def test_the_spark_backend_is_a_launcher_backend_over_spark_jobs():
    from hvd_spark.runner.backend import LauncherBackend
    from hvd_spark.runner.spark.spark_launcher import SparkJob

    backend = SparkBackend(num_proc=3, verbose=0, env={"A": "1"})
    assert isinstance(backend, LauncherBackend) and backend.launcher is SparkJob
    hooked = backend.with_options(use_gpu=False, verbose=2, progress=print)
    # What the user set stays; what they left unset the Estimator fills in.
    assert (hooked.config.verbose, hooked.config.use_gpu, hooked.config.progress) == (
        0, False, print)
    assert backend.config.use_gpu is None and hooked.num_processes() == 3


def test_a_duck_typed_backend_only_runs():
    from hvd_spark.runner.backend import as_backend

    class Horovods:
        def run(self, fn, args=(), kwargs=None, env=None):
            return [fn(*args)]

        def num_processes(self):
            return 1

    adapted = as_backend(Horovods())
    assert adapted.run(lambda x: x + 1, args=(1,)) == [2]
    adapted.check()  # nothing to check
    assert adapted.for_retry(2, wait_s=0) is adapted
    with pytest.raises(ConfigError, match="backend must be a Backend"):
        as_backend("spark")
