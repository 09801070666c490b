"""Keras (and TensorFlow) imported without TensorFlow's native start-up messages, for
``transform``'s workers.

Every Python worker that runs a Keras model's predictions imports TensorFlow once, and
TensorFlow (2.21 at the time of writing) then writes lines such as ``WARNING: All log
messages before absl::InitializeLog() is called are written to STDERR`` and ``I0000 ...
oneDNN custom operations are on ...`` straight to file descriptor 2, twice, before any
setting is read: ``TF_CPP_MIN_LOG_LEVEL`` does not hide them. With one worker per core
that floods the driver's console (local mode) or the executors' logs on every
``transform``.

``import_keras_quietly`` imports Keras (which imports TensorFlow when that is its
backend) with descriptor 2 pointed at ``/dev/null``, and sets ``TF_CPP_MIN_LOG_LEVEL=2``
(unless set) for what TensorFlow logs later. An import error still raises, with its
message, after stderr is restored. Setting ``TF_CPP_MIN_LOG_LEVEL=0`` shows everything
again. No pyspark here: it runs in the workers.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

#: ``TF_CPP_MIN_LOG_LEVEL`` set when the user has not: INFO and WARNING lines hidden.
LEVEL = "2"


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def import_keras_quietly() -> None:
    """Import Keras, hiding what TensorFlow's native libraries print while they load.

    Does nothing when Keras is already imported, and only sets the log level (hides
    nothing) when the user asked for TensorFlow's messages with ``TF_CPP_MIN_LOG_LEVEL=0``.
    """
    if "keras" in sys.modules:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", LEVEL)
    if os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0":
        return
    with _stderr_silenced():
        import keras  # noqa: F401 - the import is the point
