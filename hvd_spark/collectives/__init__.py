"""Framework-free collectives on numpy arrays: Horovod's API without the frameworks.

Importing this package never imports pyspark, torch or tensorflow, and imports nothing
until a name is first used: a rank's process that only reports through
``collectives.tcp`` (``hvd_spark.runner.worker``) does not pay for the whole API.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

# The names are ``api.__all__`` (the one list) and the ``elastic`` submodule; ``api`` is
# imported when the first of them is used, not with the package.
_API = "hvd_spark.collectives.api"


def __getattr__(name: str) -> Any:
    if name == "elastic":
        return importlib.import_module("hvd_spark.collectives.elastic")
    missing = AttributeError(f"module 'hvd_spark.collectives' has no attribute {name!r}")
    if name.startswith("__") and name != "__all__":  # probes (__wrapped__, ...) load nothing
        raise missing
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # ``from hvd_spark.collectives import ops``: the import system loads the submodule
        # once this fails; loading the API here would import the engine from inside it.
        raise missing
    api = importlib.import_module(_API)
    if name == "__all__":
        return sorted([*api.__all__, "elastic"])
    if name not in api.__all__:
        raise missing
    value = getattr(api, name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__getattr__("__all__")))
