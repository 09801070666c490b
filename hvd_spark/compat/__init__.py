"""Opt-in compatibility with other projects' import paths.

:func:`enable_horovod_alias` lets code written for Horovod run unchanged:
``import horovod.torch as hvd`` then gives ``hvd_spark.torch`` itself. It is never on by
default, and it refuses to stand in for a real Horovod installation. Turn it on with one
call, or put :data:`ALIAS_PATH` on ``PYTHONPATH`` (``hvd-compat-path`` prints it), or set
``HVD_SPARK_HOROVOD_ALIAS=1`` for ranks that hvd_spark starts (``HorovodRunner`` does).
"""

from __future__ import annotations

from pathlib import Path

from hvd_spark.compat.horovod_alias import enable_horovod_alias, horovod_alias_enabled

#: A directory holding only a ``horovod`` package that turns the alias on when imported:
#: put it on ``PYTHONPATH`` to run Horovod scripts and test suites unchanged.
ALIAS_PATH = str(Path(__file__).resolve().parent / "path")

__all__ = ["ALIAS_PATH", "enable_horovod_alias", "horovod_alias_enabled"]
