"""The opt-in ``horovod`` alias: Horovod's module paths served by hvd_spark's own modules.

A meta-path finder answers imports of ``horovod`` and ``horovod.*``. Where a Horovod
module has an hvd_spark counterpart (``horovod.torch`` -> ``hvd_spark.torch``,
``horovod.spark.keras`` -> ``hvd_spark.estimator``, ...), the import gives that very
module object: there is never a second copy of the engine. Modules that Horovod uses only
to group others (``horovod``, ``horovod.spark``, ...) are fresh package modules that look
names up on their counterpart, so importing a child never sets attributes on
hvd_spark's own modules.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

from hvd_spark.errors import ConfigError

#: Whole subtrees: ``horovod.torch.X`` is ``hvd_spark.torch.X`` wherever that exists.
_SUBTREES = {"horovod.torch": "hvd_spark.torch", "horovod.tensorflow": "hvd_spark.tensorflow",
             "horovod.keras": "hvd_spark.keras"}
#: Grouping packages -> the module their names are looked up on (None: no names).
_PACKAGES: dict[str, str | None] = {
    "horovod": "hvd_spark",
    "horovod.spark": "hvd_spark",
    "horovod.spark.common": None,
    "horovod.spark.lightning": "hvd_spark.estimator.lightning",
}
#: Single modules.
_MODULES = {
    "horovod.spark.keras": "hvd_spark.estimator",
    "horovod.spark.torch": "hvd_spark.estimator",
    "horovod.spark.lightning.estimator": "hvd_spark.estimator.lightning",
    "horovod.spark.task": "hvd_spark.task",
    "horovod.spark.common.store": "hvd_spark.data",
    "horovod.spark.common.backend": "hvd_spark.runner.backend",
    "horovod.spark.common.util": "hvd_spark.data.dataset_index",
}
_ALIAS_DIR = Path(__file__).resolve().parent / "path"


def counterpart(name: str) -> str | None:
    """The hvd_spark module serving Horovod module ``name`` (None: none, or a package)."""
    if name in _MODULES:
        return _MODULES[name]
    for prefix, target in _SUBTREES.items():
        if name == prefix or name.startswith(prefix + "."):
            return target + name[len(prefix):]
    return None


def _delegate(module: types.ModuleType, target: str | None) -> None:
    """Make ``module`` a package whose missing attributes are ``target``'s."""
    module.__path__ = []  # a package: its children come through the finder

    def __getattr__(attr: str) -> Any:  # noqa: N807 - a module's attribute hook
        if target is None or attr.startswith("__"):
            raise AttributeError(f"module {module.__name__!r} has no attribute {attr!r}")
        return getattr(importlib.import_module(target), attr)

    def __dir__() -> list[str]:  # noqa: N807 - a module's dir() hook
        names = set(vars(module))
        if target is not None:
            names |= set(dir(importlib.import_module(target)))
        return sorted(names)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    module.__dir__ = __dir__  # type: ignore[method-assign]


class _HorovodFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``horovod.*`` and loads each as its hvd_spark counterpart."""

    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "horovod" and not fullname.startswith("horovod."):
            return None
        if fullname in _PACKAGES:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        real = counterpart(fullname)
        if real is None:
            return None
        try:
            if importlib.util.find_spec(real) is None:
                return None
        except ModuleNotFoundError:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name in _PACKAGES:
            module = types.ModuleType(spec.name, f"Horovod's {spec.name}, served by hvd_spark")
            _delegate(module, _PACKAGES[spec.name])
            return module
        real = counterpart(spec.name)
        assert real is not None  # find_spec answered only for names with a counterpart
        return importlib.import_module(real)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is hvd_spark's, already imported."""


def horovod_alias_enabled() -> bool:
    """True when ``import horovod...`` is served by hvd_spark in this process."""
    return any(isinstance(f, _HorovodFinder) for f in sys.meta_path)


def enable_horovod_alias() -> None:
    """Serve ``import horovod.torch as hvd`` (and Horovod's other paths) by hvd_spark.

    Safe to call more than once.

    Raises:
        ConfigError: A real Horovod is installed (or already imported): the alias never
            shadows it.
    """
    if horovod_alias_enabled():
        return
    loaded = sys.modules.get("horovod")
    if loaded is not None and not _is_ours(getattr(loaded, "__file__", None)):
        raise ConfigError(
            f"a real Horovod is already imported ({loaded.__file__}): the hvd_spark alias "
            "never stands in for it; import hvd_spark.torch (etc.) directly instead")
    spec = importlib.machinery.PathFinder.find_spec("horovod")
    if spec is not None and not _is_ours(spec.origin):
        raise ConfigError(
            f"a real Horovod is installed ({spec.origin}): the hvd_spark alias never shadows "
            "it; uninstall horovod to run this code on hvd_spark, or import hvd_spark.torch "
            "(etc.) directly")
    sys.meta_path.insert(0, _HorovodFinder())  # before the path finder: ours answers first


def adopt_package(namespace: dict[str, Any]) -> None:
    """Turn the alias on from ``horovod/__init__.py`` in :data:`ALIAS_PATH`, and make that
    package look names up on ``hvd_spark``."""
    if not horovod_alias_enabled():
        sys.meta_path.insert(0, _HorovodFinder())
    _delegate(sys.modules[namespace["__name__"]], _PACKAGES["horovod"])
    namespace["__path__"] = []


def _is_ours(origin: str | None) -> bool:
    return origin is not None and Path(origin).resolve().is_relative_to(_ALIAS_DIR)
