"""``horovod``, served by hvd_spark: on ``PYTHONPATH`` only by the user's choice.

Importing it turns on ``hvd_spark.compat``'s alias: ``horovod.torch`` is ``hvd_spark.torch``,
``horovod.spark`` is ``hvd_spark``'s launchers and Estimators, and so on.
"""

from hvd_spark.compat.horovod_alias import adopt_package

adopt_package(globals())
