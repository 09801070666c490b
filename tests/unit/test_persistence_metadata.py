"""Model metadata is read through pyarrow: ours, or the part file Spark's writer left."""

from __future__ import annotations

import json

import pytest

from hvd_spark.errors import ConfigError
from hvd_spark.estimator.persistence import read_metadata


def test_reads_spark_written_metadata_and_skips_hidden_files(tmp_path):
    meta = tmp_path / "m" / "metadata"
    meta.mkdir(parents=True)
    line = json.dumps({"class": "x.Y", "uid": "Y_1", "paramMap": {}})
    (meta / "_SUCCESS").write_bytes(b"")
    (meta / ".part-00000-abc-c000.txt.crc").write_bytes(b"\x00crc")
    (meta / "part-00000-abc-c000.txt").write_text(line + "\n")
    assert json.loads(read_metadata(str(tmp_path / "m"))) == json.loads(line)
    assert json.loads(read_metadata(f"file://{tmp_path}/m"))["uid"] == "Y_1"


def test_missing_metadata_is_a_config_error(tmp_path):
    (tmp_path / "empty" / "metadata").mkdir(parents=True)
    for path in (tmp_path / "empty", tmp_path / "absent"):
        with pytest.raises(ConfigError, match="holds no saved estimator or model"):
            read_metadata(str(path))
