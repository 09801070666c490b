"""``hvd_spark.keras.elastic``: Horovod's ``horovod.keras.elastic`` (the TensorFlow binding's)."""

from hvd_spark.tensorflow.elastic import *  # noqa: F403 - deliberate alias module
from hvd_spark.tensorflow.elastic import __all__  # noqa: F401
