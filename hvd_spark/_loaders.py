"""Where the framework bindings hand the data layer their loaders (no import upward).

``Converter.make_torch_dataloader`` / ``make_tf_dataset`` (petastorm's API puts the
framework loaders on the converter) live in the data layer, which imports no framework
and no binding. Each binding registers its loader here when it is imported
(``import hvd_spark.torch`` / ``import hvd_spark.tensorflow``, what a rank does before
``hvd.init()``), and the converter asks for it by framework name. This module imports
nothing of the package but its errors, so registering costs a binding nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hvd_spark.errors import ConfigError

# framework -> (the binding that registers it, what Converter's method is called)
_BINDINGS = {"torch": ("hvd_spark.torch", "make_torch_dataloader"),
             "tensorflow": ("hvd_spark.tensorflow", "make_tf_dataset")}
_loaders: dict[str, Callable[..., Any]] = {}


def register(framework: str, factory: Callable[..., Any]) -> None:
    """Make ``factory(stream, **options)`` the loader of ``framework`` (a binding's import)."""
    if framework not in _BINDINGS:
        raise ValueError(f"unknown framework {framework!r}; known: {sorted(_BINDINGS)}")
    _loaders[framework] = factory


def loader(framework: str) -> Callable[..., Any]:
    """The loader factory ``framework``'s binding registered.

    Raises:
        ConfigError: The binding was not imported in this process, naming the import.
    """
    try:
        return _loaders[framework]
    except KeyError:
        binding, method = _BINDINGS[framework]
        raise ConfigError(
            f"Converter.{method} needs {binding}: import it in the rank first "
            f"(import {binding} as hvd), as for hvd.init()") from None
