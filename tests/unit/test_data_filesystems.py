"""URL -> pyarrow filesystem: s3a, dbfs, file: spellings, storage options, registered options."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import pytest
from pyarrow import fs as pafs

from hvd_spark.data import filesystems
from hvd_spark.data.filesystems import filesystem_from_url
from hvd_spark.errors import ConfigError


def test_local_spellings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url in (str(tmp_path / "a"), f"file://{tmp_path}/a", f"file:{tmp_path}/a", "a", "./a"):
        fs, path = filesystem_from_url(url)
        assert isinstance(fs, pafs.LocalFileSystem) and path == f"{tmp_path}/a", url
    assert filesystem_from_url("dbfs:/ml/x")[1] == "/dbfs/ml/x"
    with pytest.raises(ConfigError, match="names a file on host"):
        filesystem_from_url("file://otherhost/x")


def test_s3a_and_s3n_are_s3():
    for scheme in ("s3", "s3a", "s3n"):
        fs, path = filesystem_from_url(f"{scheme}://bkt/a/b?endpoint_override=127.0.0.1:1"
                                       "&scheme=http&region=us-east-1")
        assert fs.type_name == "s3" and path == "bkt/a/b", scheme
    assert filesystems.normalize_url("s3a://bkt/x") == "s3://bkt/x"
    assert filesystems.scheme_of("S3A://bkt/x") == "s3"
    assert filesystems.is_local("dbfs:/x") and not filesystems.is_local("s3a://b/x")


def test_s3fs_style_storage_options():
    keywords = filesystems.s3_keywords({
        "key": "AK", "secret": "SK", "token": "T", "anon": False,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"},
    })
    assert keywords == {"access_key": "AK", "secret_key": "SK", "session_token": "T",
                        "anonymous": False, "endpoint_override": "127.0.0.1:9000",
                        "scheme": "http", "region": "eu-west-1"}
    assert filesystems.s3_keywords({"allow_bucket_creation": "true", "connect_timeout": "2"}) == \
        {"allow_bucket_creation": True, "connect_timeout": 2.0}
    with pytest.raises(ConfigError, match="unknown S3 storage option 'bogus'"):
        filesystems.s3_keywords({"bogus": 1})


def test_registered_options_reach_plain_urls_of_the_same_bucket():
    filesystems.register_options("s3a://reg-bucket/prefix",
                                 {"endpoint_override": "127.0.0.1:1", "scheme": "http",
                                  "region": "us-east-1", "access_key": "a", "secret_key": "b"})
    assert filesystems.registered_options("s3://reg-bucket/other")["access_key"] == "a"
    assert filesystems.registered_options("s3://another-bucket/x") == {}
    fs, path = filesystem_from_url("s3a://reg-bucket/models/m")  # no query: options apply
    assert fs.type_name == "s3" and path == "reg-bucket/models/m"
    filesystems.register_options("/local/path", {"x": 1})  # ignored for local paths
    assert filesystems.registered_options("/local/path") == {}


def test_hdfs_keywords_from_url_and_options():
    split = urlsplit("hdfs://nn:9000/user/x")
    assert filesystems.hdfs_keywords(split, {"user": "bob"}) == {
        "host": "nn", "port": 9000, "user": "bob"}
    assert filesystems.hdfs_keywords(urlsplit("hdfs:///user/x"), {}) == {
        "host": "default", "port": 0}
    assert filesystems.hdfs_keywords(urlsplit("hdfs://nn/user/x"), {"port": "8021"})["port"] == 8021
    with pytest.raises(ConfigError, match="unknown HDFS option"):
        filesystems.hdfs_keywords(split, {"driver": "libhdfs3"})


def test_unsupported_or_bad_urls_are_config_errors():
    with pytest.raises(ConfigError, match="cannot open a filesystem for 'nosuchfs://host/x'"):
        filesystem_from_url("nosuchfs://host/x")
    with pytest.raises(ConfigError, match="non-empty string"):
        filesystem_from_url("")
    with pytest.raises(ConfigError, match="not a DBFS path"):
        filesystems.dbfs_local_path("/tmp/x")


def test_strip_query_and_unsplit():
    assert filesystems.strip_query("s3://b/p?region=x") == "s3://b/p"
    assert filesystems.strip_query("/local/p") == "/local/p"
    assert filesystems.unsplit(urlsplit("hdfs:///user/x")) == "hdfs:///user/x"
    assert os.path.isabs(filesystems.local_path("~/x"))


def test_the_urls_own_query_wins_over_registered_options():
    filesystems.register_options("s3://prio-bucket/x", {
        "client_kwargs": {"endpoint_url": "http://10.0.0.1:1"}, "region": "us-east-1"})
    fs, _ = filesystem_from_url("s3a://prio-bucket/y?endpoint_override=127.0.0.1:2&scheme=http")
    assert "127.0.0.1:2" in repr(fs.__reduce__())
    fs, _ = filesystem_from_url("s3a://prio-bucket/y")
    assert "10.0.0.1:1" in repr(fs.__reduce__())
