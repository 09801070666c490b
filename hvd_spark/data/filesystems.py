"""URLs -> ``pyarrow.fs`` filesystems, with the URL forms Spark users write.

Beyond what ``pyarrow.fs.FileSystem.from_uri`` takes, this module understands:

- ``s3a://`` and ``s3n://`` (Hadoop's names for S3): read as ``s3://``.
- ``dbfs:/x`` (Databricks): the local FUSE mount ``/dbfs/x``, as Databricks maps it.
- local paths, relative or absolute, and ``file:`` URLs in all three spellings.
- per-bucket (per-host) options registered by a Store (``storage_options`` or the query
  string of its prefix URL), so that a plain ``s3a://bucket/run/model`` URL opened later
  (``model.save``, the reader on a worker) reaches the same endpoint with the same
  credentials. The options stay in memory: they are never written into a stored file.
"""

from __future__ import annotations

import os
import posixpath
import threading
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from pyarrow import fs as pafs

from hvd_spark.errors import ConfigError

_SCHEME_ALIASES = {"s3a": "s3", "s3n": "s3"}
# s3fs (fsspec) spellings of Horovod users' storage_options -> pyarrow S3FileSystem keywords.
_S3FS_NAMES = {"key": "access_key", "secret": "secret_key", "token": "session_token",
               "anon": "anonymous", "endpoint_url": "endpoint_override",
               "region_name": "region"}
_S3_KEYWORDS = {"access_key", "secret_key", "session_token", "anonymous", "region",
                "request_timeout", "connect_timeout", "scheme", "endpoint_override",
                "background_writes", "role_arn", "session_name", "external_id",
                "allow_bucket_creation", "allow_bucket_deletion", "force_virtual_addressing",
                "tls_ca_file_path", "proxy_options"}
_HDFS_KEYWORDS = {"host", "port", "user", "kerb_ticket", "extra_conf", "replication",
                  "buffer_size", "default_block_size"}

_lock = threading.Lock()
_options: dict[tuple[str, str], dict[str, Any]] = {}


def scheme_of(url: str) -> str:
    """The URL's scheme after aliasing (``s3a`` -> ``s3``); ``""`` for a local path."""
    scheme = urlsplit(url).scheme.lower()
    # A one-letter scheme is a Windows drive letter, not a URL scheme.
    if len(scheme) <= 1 or scheme == "file":
        return ""
    if scheme == "dbfs":
        return ""
    return _SCHEME_ALIASES.get(scheme, scheme)


def is_local(url: str) -> bool:
    """Whether ``url`` names the local filesystem (including ``file:`` and ``dbfs:/``)."""
    return scheme_of(url) == ""


def dbfs_local_path(url: str) -> str:
    """``dbfs:/x``, ``file:/dbfs/x`` or ``/dbfs/x`` -> ``/dbfs/x``; ConfigError for others."""
    if url.startswith("dbfs:/") and not url.startswith("dbfs://"):
        return "/dbfs/" + url[len("dbfs:"):].lstrip("/")
    local = local_path(url) if url.startswith("file:") or url.startswith("/") else ""
    if local == "/dbfs" or local.startswith("/dbfs/"):
        return local
    raise ConfigError(
        f"{url!r} is not a DBFS path: use dbfs:/..., /dbfs/..., file:/dbfs/... or file:///dbfs/..."
    )


def local_path(url: str) -> str:
    """Absolute local path of a local path or ``file:``/``dbfs:/`` URL."""
    if url.startswith("dbfs:"):
        return dbfs_local_path(url)
    if url.startswith("file:"):
        split = urlsplit(url)
        if split.netloc not in ("", "localhost"):
            raise ConfigError(f"{url!r} names a file on host {split.netloc!r}; use file:///path")
        url = split.path
    return os.path.abspath(os.path.expanduser(url))


def normalize_url(url: str) -> str:
    """Local paths -> absolute paths; ``s3a``/``s3n`` -> ``s3``; other URLs unchanged."""
    if is_local(url):
        return local_path(url)
    split = urlsplit(url)
    scheme = scheme_of(url)
    if scheme != split.scheme:
        return unsplit(split._replace(scheme=scheme))
    return url


def unsplit(split: Any) -> str:
    """``urlunsplit`` that keeps ``//`` before an empty host (``hdfs:///path``)."""
    url = f"{split.scheme}://{split.netloc}{split.path}"
    return url + (f"?{split.query}" if split.query else "")


def join_url(url: str, *parts: str) -> str:
    """Join path ``parts`` onto ``url``, keeping its scheme, host and query string.

    Args:
        url: A local path or a URL such as ``s3://bucket/prefix?endpoint_override=...``.
        *parts: Relative path components (``/``-separated).

    Returns:
        The joined path or URL.
    """
    parts = tuple(p.strip("/") for p in parts if p)
    if url.startswith("dbfs:"):
        url = local_path(url)
    if is_local(url) and not url.startswith("file:"):
        return os.path.join(url, *parts)
    split = urlsplit(url)
    return unsplit(split._replace(path=posixpath.join(split.path or "/", *parts)))


def register_options(url: str, options: dict[str, Any]) -> None:
    """Remember ``options`` for every later URL on the same scheme and bucket/host as ``url``."""
    if not options or is_local(url):
        return
    key = (scheme_of(url), urlsplit(url).netloc.rpartition("@")[2])
    with _lock:
        _options[key] = dict(options)


def registered_options(url: str) -> dict[str, Any]:
    """The options registered for ``url``'s scheme and bucket/host (empty if none)."""
    if is_local(url):
        return {}
    key = (scheme_of(url), urlsplit(url).netloc.rpartition("@")[2])
    with _lock:
        return dict(_options.get(key, {}))


def url_options(url: str) -> dict[str, Any]:
    """Options given in the query string of ``url`` (``?endpoint_override=...&region=...``)."""
    return dict(parse_qsl(urlsplit(url).query))


def strip_query(url: str) -> str:
    """``url`` without its query string (options stay registered, not in the path)."""
    if is_local(url):
        return url
    return unsplit(urlsplit(url)._replace(query=""))


def filesystem_from_url(
    url: str, options: dict[str, Any] | None = None
) -> tuple[pafs.FileSystem, str]:
    """Return ``(filesystem, path)`` for a local path or URL.

    Args:
        url: Local path (relative paths are taken from the working directory), ``file:``,
            ``dbfs:/``, ``s3://``/``s3a://``, ``hdfs://``, ``gs://``, ... URL.
        options: Filesystem keywords (pyarrow's names, or s3fs's ``key``/``secret``/
            ``client_kwargs``); default: those registered for the URL's bucket or host.

    Returns:
        The filesystem and the path on it.

    Raises:
        ConfigError: The scheme is not supported, an option is unknown, or the filesystem
            cannot be created (e.g. libhdfs is missing for ``hdfs://``).
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(f"a path or URL must be a non-empty string, got {url!r}")
    if is_local(url):
        return pafs.LocalFileSystem(), local_path(url)
    scheme = scheme_of(url)
    # Later sources win: registered for the bucket, then the URL's query, then ``options``.
    sources = (registered_options(url), url_options(url), options or {})
    merged = {k: v for source in sources for k, v in source.items()}
    split = urlsplit(normalize_url(url))
    try:
        if scheme == "s3" and (merged or split.username):
            keywords = {k: v for source in sources for k, v in s3_keywords(source).items()}
            if split.username:  # s3://KEY:SECRET@bucket/path, as pyarrow's from_uri takes
                keywords.setdefault("access_key", unquote(split.username))
                keywords.setdefault("secret_key", unquote(split.password or ""))
            if "region" not in keywords and "endpoint_override" not in keywords:
                keywords["region"] = pafs.resolve_s3_region(split.hostname)
            fs = pafs.S3FileSystem(**keywords)
            return fs, (split.netloc.rpartition("@")[2] + split.path).rstrip("/")
        if scheme == "hdfs":
            fs = pafs.HadoopFileSystem(**hdfs_keywords(split, merged))
            return fs, split.path or "/"
        if merged and not url_options(url):
            # Other schemes (gs, abfs, ...): pyarrow parses them; options go in the query.
            url = unsplit(split._replace(query=urlencode(_plain(merged))))
        return pafs.FileSystem.from_uri(normalize_url(url))
    except ConfigError:
        raise
    except (ValueError, OSError, TypeError) as exc:  # pyarrow's ArrowInvalid/ArrowIOError
        raise ConfigError(
            f"cannot open a filesystem for {strip_query(url)!r}: {exc}. Use a local path or a "
            "URL pyarrow supports (file://, hdfs://, s3:// or s3a://, gs://, abfs://, dbfs:/) "
            "and check the options and credentials"
        ) from exc


def s3_keywords(options: dict[str, Any]) -> dict[str, Any]:
    """pyarrow ``S3FileSystem`` keywords from pyarrow or s3fs spellings of the options."""
    out: dict[str, Any] = {}
    flat = dict(options)
    client = flat.pop("client_kwargs", None) or {}
    for source in (flat, client):
        for name, value in source.items():
            name = _S3FS_NAMES.get(name, name)
            if name not in _S3_KEYWORDS:
                raise ConfigError(
                    f"unknown S3 storage option {name!r}; use pyarrow.fs.S3FileSystem's "
                    f"keywords ({', '.join(sorted(_S3_KEYWORDS))}) or s3fs's key/secret/token/"
                    "client_kwargs"
                )
            out[name] = value
    endpoint = out.get("endpoint_override")
    if isinstance(endpoint, str) and "://" in endpoint:  # s3fs takes http://host:port
        scheme, _, rest = endpoint.partition("://")
        out["endpoint_override"] = rest.rstrip("/")
        out.setdefault("scheme", scheme)
    for name in ("anonymous", "allow_bucket_creation", "allow_bucket_deletion",
                 "background_writes", "force_virtual_addressing"):
        if isinstance(out.get(name), str):  # from a query string
            out[name] = out[name].lower() in ("1", "true", "yes")
    for name in ("request_timeout", "connect_timeout"):
        if isinstance(out.get(name), str):
            out[name] = float(out[name])
    return out


def hdfs_keywords(split: Any, options: dict[str, Any]) -> dict[str, Any]:
    """pyarrow ``HadoopFileSystem`` keywords: host/port from the URL unless given."""
    unknown = sorted(set(options) - _HDFS_KEYWORDS)
    if unknown:
        raise ConfigError(f"unknown HDFS option(s) {unknown}; known: {sorted(_HDFS_KEYWORDS)}")
    out = {k: v for k, v in options.items() if v is not None}
    out.setdefault("host", split.hostname or "default")
    out.setdefault("port", split.port or (8020 if split.hostname else 0))
    out["port"] = int(out["port"])
    return out


def _plain(options: dict[str, Any]) -> dict[str, str]:
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in options.items()}
