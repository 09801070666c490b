"""``hvd_spark.tensorflow.keras.callbacks``: Horovod's ``horovod.tensorflow.keras.callbacks``.

This name is the very module :mod:`hvd_spark.tensorflow.callbacks`, not a copy: the package's
``hvd.callbacks`` and this import stay one object, so a patched or subclassed callback is the
same everywhere (``from hvd_spark.tensorflow.keras.callbacks import BestModelCheckpoint``).
"""

import sys

from hvd_spark.tensorflow import callbacks as _callbacks

# After this file runs, the import system hands out whatever sys.modules holds for the name.
sys.modules[__name__] = _callbacks
