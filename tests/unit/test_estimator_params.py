"""Horovod's Estimator parameters: names, accessors, signatures, ignored ones, the backend
rule, input shapes and the batch source (no Spark job: pure parameter handling)."""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
import torch
from pyspark.ml.tuning import ParamGridBuilder

import hvd_spark
import hvd_spark.runner
from hvd_spark import _env
from hvd_spark.errors import ConfigError, DataError
from hvd_spark.estimator import KerasEstimator, SparkBackend, TorchEstimator
from hvd_spark.estimator.params import IGNORED
from hvd_spark.estimator.train_spec import BatchSource, batch_shape
from hvd_spark.runner.api import horovod_keywords

# Every parameter of Horovod 0.28.1's TorchEstimator / KerasEstimator constructors.
HOROVOD_SHARED = [
    "num_proc", "data_module", "model", "backend", "store", "optimizer", "loss", "metrics",
    "loss_weights", "sample_weight_col", "gradient_compression", "feature_cols",
    "continuous_cols", "categorical_cols", "validation", "label_cols", "callbacks",
    "batch_size", "val_batch_size", "epochs", "verbose", "random_seed", "shuffle_buffer_size",
    "shuffle", "partitions_per_process", "run_id", "train_steps_per_epoch",
    "validation_steps_per_epoch", "transformation_fn", "train_reader_num_workers",
    "val_reader_num_workers", "reader_pool_type", "label_shapes", "inmemory_cache_all",
    "use_gpu", "mp_start_method", "backward_passes_per_step",
]
HOROVOD_TORCH = HOROVOD_SHARED + ["loss_constructors", "input_shapes", "train_minibatch_fn"]
HOROVOD_KERAS = HOROVOD_SHARED + ["custom_objects", "checkpoint_callback", "backend_env",
                                  "tensorflow_dataset_prefetch_buffer_size"]


def _torch_kwargs(**overrides):
    model = torch.nn.Linear(4, 2)
    kwargs = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  loss=torch.nn.CrossEntropyLoss(), feature_cols=["f"], label_cols=["y"])
    kwargs.update(overrides)
    return kwargs


@pytest.mark.parametrize("cls,names", [(TorchEstimator, HOROVOD_TORCH),
                                       (KerasEstimator, HOROVOD_KERAS)])
def test_signature_lists_every_horovod_parameter(cls, names):
    signature = inspect.signature(cls.__init__)
    assert set(names) <= set(signature.parameters), set(names) - set(signature.parameters)
    assert all(p.kind != p.VAR_KEYWORD for p in signature.parameters.values())
    est = cls()
    for name in names:  # a Param of Horovod's name, with setX/getX accessors
        assert est.getParam(name).name == name
        upper = "".join(part.capitalize() for part in name.split("_"))
        assert callable(getattr(est, f"get{upper}")) and callable(getattr(est, f"set{upper}"))
    assert "batch_size" in (cls.__init__.__doc__ or "") + str(signature)


def test_snake_case_params_work_with_spark_ml_tools():
    est = TorchEstimator(**_torch_kwargs(batch_size=16))
    assert est.getOrDefault("batch_size") == 16 == est.getBatchSize()
    assert est.getOrDefault("use_gpu") is True  # Horovod's default
    assert est.setEpochs(3) is est and est.getEpochs() == 3
    grid = ParamGridBuilder().addGrid(est.batch_size, [8, 64]).build()
    assert sorted(est.copy(m).getBatchSize() for m in grid) == [8, 64]
    # Horovod's irregular accessor names are there too.
    est.setInMemoryCacheAll(True)
    assert est.getInMemoryCacheAll() is True and est.getShufflingBufferSize() is None
    assert est.getTrainReaderNumWorker() is None


def test_unknown_or_positional_arguments_are_config_errors():
    with pytest.raises(ConfigError, match=r"unknown parameter\(s\) \['lr'\]"):
        TorchEstimator(lr=0.1)
    with pytest.raises(ConfigError, match="keyword arguments only"):
        TorchEstimator(2)
    with pytest.raises(ConfigError, match="unknown parameter"):
        TorchEstimator().setParams(bogus=1)


def test_ignored_parameters_are_accepted_and_logged_once_with_the_reason(caplog):
    with caplog.at_level(logging.INFO, logger="hvd_spark.estimator"):
        est = TorchEstimator(**_torch_kwargs(reader_pool_type="process",
                                             continuous_cols=["a"], data_module=object))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert any("reader_pool_type='process'" in m and "petastorm" in m for m in lines)
    assert est.getReaderPoolType() == "process"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hvd_spark.estimator"):
        TorchEstimator(**_torch_kwargs(reader_pool_type="thread"))  # Horovod's default
    assert not caplog.records
    with caplog.at_level(logging.INFO, logger="hvd_spark.estimator"):
        TorchEstimator(**_torch_kwargs(callbacks=[object()]))
    assert "callbacks" in caplog.text and "no callback hooks" in caplog.text
    assert set(IGNORED) <= set(inspect.signature(TorchEstimator.__init__).parameters)


def test_backend_and_num_proc_together_is_a_config_error():
    est = TorchEstimator(**_torch_kwargs(num_proc=2, backend=SparkBackend(num_proc=2)))
    with pytest.raises(ConfigError, match='"backend" and "num_proc"'):
        est.fit(None)  # fails before the DataFrame is touched
    with pytest.raises(ConfigError, match="backend must be a Backend"):
        TorchEstimator(**_torch_kwargs(backend="spark")).fit(None)


def test_spark_backend_is_exported_everywhere_horovod_users_look():
    assert hvd_spark.SparkBackend is SparkBackend is hvd_spark.runner.SparkBackend
    backend = SparkBackend(num_proc=3, env={"A": "1"}, stdout=None, stderr=None,
                           prefix_output_with_timestamp=True, verbose=2, start_timeout=30,
                           use_gpu=False, use_gloo=True, nics=["lo"])
    assert backend.num_processes() == 3
    with pytest.raises(ConfigError, match="num_proc"):
        SparkBackend(num_proc=0)
    with pytest.raises(ConfigError, match=r"unknown keyword\(s\) \['bogus'\]"):
        SparkBackend(bogus=1)


def test_run_takes_horovods_remaining_keywords(caplog):
    with caplog.at_level(logging.INFO, logger="hvd_spark.runner"):
        env = horovod_keywords({"A": "1"}, extra_mpi_args="-x FOO", nics={"eth1", "eth0"},
                               executable="/usr/bin/python3", use_mpi=None, use_gloo=True)
    assert env == {"A": "1", _env.IFACE: "eth0"}
    text = caplog.text
    assert "extra_mpi_args" in text and "executable" in text and "ignored" in text
    with caplog.at_level(logging.INFO, logger="hvd_spark.runner"):
        horovod_keywords(None, extra_mpi_args=None, nics=None, executable=None,
                         use_mpi=True, use_gloo=None)
    assert "use_mpi=True is ignored" in caplog.text
    with pytest.raises(ConfigError, match="use_mpi and use_gloo"):
        horovod_keywords(None, extra_mpi_args=None, nics=None, executable=None,
                         use_mpi=True, use_gloo=True)
    run_params = inspect.signature(hvd_spark.run).parameters
    assert {"use_gloo", "use_mpi", "extra_mpi_args", "nics", "executable"} <= set(run_params)


def test_input_shapes_accept_horovods_batch_dimension_or_a_row_shape():
    assert batch_shape([-1, 1, 28, 28], "input_shapes") == (-1, 1, 28, 28)
    assert batch_shape([1, 28, 28], "input_shapes") == (-1, 1, 28, 28)
    assert batch_shape([-1, 784], "input_shapes", row_size=784) == (-1, 784)
    with pytest.raises(ConfigError, match="only a leading batch dimension may be -1"):
        batch_shape([-1, -1, 28], "input_shapes")
    with pytest.raises(ConfigError, match=r"input_shapes \(column 'f'\).*holds 785 values"):
        batch_shape([-1, 785], "input_shapes (column 'f')", row_size=784)
    est = TorchEstimator(**_torch_kwargs(input_shapes=[[-1, 4], [-1, 2]]))
    with pytest.raises(ConfigError, match="one shape per feature column"):
        est.fit(None)


def test_torch_checks_name_the_parameter():
    model = torch.nn.Linear(4, 2)
    other = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="optimizer holds parameters that are not the model"):
        TorchEstimator(**_torch_kwargs(model=model, optimizer=other)).fit(None)
    with pytest.raises(ConfigError, match="exactly one of loss"):
        TorchEstimator(**_torch_kwargs(loss_constructors=[torch.nn.MSELoss])).fit(None)
    with pytest.raises(ConfigError, match="loss_weights must hold one weight per label"):
        TorchEstimator(**_torch_kwargs(loss_weights=[0.5, 0.5])).fit(None)
    with pytest.raises(ConfigError, match="mp_start_method must be one of"):
        TorchEstimator(**_torch_kwargs(mp_start_method="thread")).fit(None)
    with pytest.raises(ConfigError, match="label_shapes must hold one shape per label"):
        TorchEstimator(**_torch_kwargs(label_shapes=[[1], [2]])).fit(None)
    with pytest.raises(ConfigError, match=r"mixed_precision must be 'bf16', 'fp16' or None"):
        TorchEstimator(**_torch_kwargs(mixed_precision="float16")).fit(None)
    with pytest.raises(ConfigError, match="mixed_precision does not apply to a train_minibatch"):
        TorchEstimator(**_torch_kwargs(mixed_precision="bf16",
                                       train_minibatch_fn=lambda: None)).fit(None)

    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        pass

    with pytest.raises(ConfigError, match="LightningModule.*hvd_spark.estimator.lightning"):
        TorchEstimator(**_torch_kwargs(model=Module(), optimizer=None)).fit(None)


class _Reader:
    """A stand-in for ShardReader: 3 batches of 4 rows per epoch, counting reads."""

    rank, batch_size, steps_per_epoch = 0, 4, 3

    def __init__(self) -> None:
        self.reads = 0

    def epoch(self, epoch):
        self.reads += 1
        for step in range(self.steps_per_epoch):
            rows = np.arange(step * 4, step * 4 + 4, dtype=np.float32)
            x = rows.reshape(-1, 1).repeat(2, axis=1)
            x.flags.writeable = False  # the reader may hand out read-only Arrow views
            yield {"x": x, "y": rows.astype(np.int64)}


def test_batch_source_caches_in_memory_and_transforms_every_batch():
    reader = _Reader()

    def double(batch):
        batch["x"] *= 2  # in place: the source hands out writable copies
        return batch

    source = BatchSource(reader, transform=double, cache=True, shuffle=True, seed=3)
    first = list(source.epoch(0))
    second = list(source.epoch(1))
    assert reader.reads == 1, "the second epoch must come from the in-memory cache"
    assert len(second) == 3 and all(len(b["y"]) == 4 for b in second)
    rows = np.concatenate([b["y"] for b in second])
    assert sorted(rows) == list(range(12)) and list(rows) != list(range(12))
    for batch in first + second:
        assert np.array_equal(batch["x"][:, 0], 2 * batch["y"])  # transformed, rows aligned
    plain = BatchSource(_Reader())
    list(plain.epoch(0))
    list(plain.epoch(1))
    assert plain.reader.reads == 2


def test_transformation_fn_must_keep_one_row_per_row():
    source = BatchSource(_Reader(), transform=lambda b: {"x": b["x"][:2]})
    with pytest.raises(DataError, match=r"transformation_fn returned column\(s\) \['x'\]"):
        next(iter(source.epoch(0)))
    with pytest.raises(DataError, match="must return a dict"):
        next(iter(BatchSource(_Reader(), transform=lambda b: 3).epoch(0)))
