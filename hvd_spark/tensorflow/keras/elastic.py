"""``hvd_spark.tensorflow.keras.elastic``: Horovod's ``horovod.tensorflow.keras.elastic``
(``KerasState``, ``CommitStateCallback``, ``UpdateBatchStateCallback``,
``UpdateEpochStateCallback``, ``run``).

This name is the very module :mod:`hvd_spark.tensorflow.elastic`, not a copy: the package's
``hvd.elastic`` and this import stay one object.
"""

import sys

from hvd_spark.tensorflow import elastic as _elastic

# After this file runs, the import system hands out whatever sys.modules holds for the name.
sys.modules[__name__] = _elastic
