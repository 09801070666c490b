"""as_torch / as_tf_dataset (in the bindings), and importing the data layer loads no
framework or pyspark."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark.data import ShardReader


@pytest.fixture
def reader(tmp_path):
    path = str(tmp_path / "a.parquet")
    ids = np.arange(24, dtype=np.int64)
    pq.write_table(pa.table({"id": ids, "v": pa.array([[float(i)] * 3 for i in ids],
                                                       pa.list_(pa.float32()))}), path)
    return ShardReader([path], 0, 1, 8, shuffle=False)


def test_importing_the_data_layer_loads_no_framework_or_spark():
    code = ("import sys, hvd_spark.data, hvd_spark.data.converter; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'pyspark') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_as_torch(reader):
    import torch  # CI installs it: a missing package is a failure, not a skip

    from hvd_spark.torch.data import as_torch

    batches = list(as_torch(reader.epoch(0)))
    assert len(batches) == 3
    assert batches[0]["v"].dtype == torch.float32 and tuple(batches[0]["v"].shape) == (8, 3)
    assert torch.equal(batches[2]["id"], torch.arange(16, 24))


def test_as_tf_dataset(reader):
    import tensorflow as tf  # CI installs it: never a skip

    from hvd_spark.tensorflow.data import as_tf_dataset

    dataset = as_tf_dataset(reader, epoch=0)
    assert dataset.element_spec["v"].shape == (8, 3)
    assert int(dataset.cardinality()) == 3
    ids = [int(x) for batch in dataset for x in batch["id"].numpy()]
    assert ids == list(range(24))
    assert dataset.element_spec["id"].dtype == tf.int64


def test_the_moved_names_say_where_they_went():
    import hvd_spark.data

    with pytest.raises(AttributeError, match=r"hvd_spark\.torch\.data\.as_torch"):
        hvd_spark.data.as_torch  # noqa: B018 - the attribute access is the test
    with pytest.raises(AttributeError, match=r"hvd_spark\.tensorflow\.data\.as_tf_dataset"):
        hvd_spark.data.as_tf_dataset  # noqa: B018
