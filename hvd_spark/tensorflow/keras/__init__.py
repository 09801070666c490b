"""``hvd_spark.tensorflow.keras``: the same names as ``hvd_spark.tensorflow``."""

from hvd_spark.tensorflow import *  # noqa: F403 - deliberate alias module
from hvd_spark.tensorflow import __all__, callbacks  # noqa: F401
