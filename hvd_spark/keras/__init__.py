"""``hvd_spark.keras``: the same names as ``hvd_spark.tensorflow`` (Horovod's ``horovod.keras``)."""

from hvd_spark.tensorflow import *  # noqa: F403 - deliberate alias module
from hvd_spark.tensorflow import __all__, callbacks  # noqa: F401
