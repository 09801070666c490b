"""``DistributedOptimizer`` for Keras 3 optimizers.

The wrapper is a subclass of the optimizer's own class, made on the fly
(``DistributedSGD``, ``DistributedAdam``, ...), so ``model.compile``, saving and every
hyperparameter keep working. It reduces the gradients across ranks in one fused
collective before the optimizer uses them, inside the compiled ``train_function``
of ``model.fit`` as well as eagerly:

- ``backward_passes_per_step == 1``: in ``apply`` (what ``apply_gradients`` and
  ``model.fit`` call), before loss-scale unscaling, clipping and the update.
- ``backward_passes_per_step == n > 1``: Keras's own ``gradient_accumulation_steps=n``
  accumulates locally and the reduction runs only on the n-th step, on the averaged
  accumulated gradients, just before clipping.

Saving: each class is registered with Keras as ``hvd_spark>Distributed<Name>``; the
built-in optimizers are registered when this module is imported, so
``keras.models.load_model`` works after ``import hvd_spark.tensorflow``. For a custom
optimizer class, call ``DistributedOptimizer`` on one instance (or pass
``custom_objects``) before loading.
"""

from __future__ import annotations

import inspect
from typing import Any

import keras

from hvd_spark import collectives as C
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.errors import ConfigError
from hvd_spark.tensorflow.compression import Compression, Compressor, compression_name
from hvd_spark.tensorflow.gradients import allreduce_gradients, check_reduce_args
from hvd_spark.tensorflow.ops import check_same_everywhere

_CONFIG_KEY = "hvd_spark"
_GRADS_NAME = "DistributedOptimizer.grads"
_CLASSES: dict[type, type] = {}


class _DistributedMixin:
    """Reduces gradients across ranks before the wrapped optimizer class uses them."""

    def __init__(self, *args: Any, hvd_spark: dict | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = dict(hvd_spark or {})
        compression = settings.get("compression", "none")
        self._hvd_compression = getattr(Compression, compression)
        self._hvd_op = check_reduce_args(
            ReduceOp(settings.get("op", int(ReduceOp.Average))),
            float(settings.get("gradient_predivide_factor", 1.0)), "DistributedOptimizer")
        self._hvd_predivide = float(settings.get("gradient_predivide_factor", 1.0))
        self._hvd_accumulating = bool(self.gradient_accumulation_steps)
        self._hvd_checked = False

    def _hvd_check(self, grads: list, variables: Any) -> None:
        # Once, at the first (trace of) apply, which every rank reaches at the same
        # step: a different model becomes a clear error here, not a fused-buffer
        # size mismatch deep inside a graph error. Paths may differ between ranks
        # (Keras numbers layer names per process), so only shapes and dtypes count.
        self._hvd_checked = True
        if C.size() == 1:
            return
        variables = list(variables) if variables is not None else self._trainable_variables
        signature = [(tuple(v.shape), str(v.dtype)) for g, v in zip(grads, variables)
                     if g is not None]
        check_same_everywhere(signature, "DistributedOptimizer.check", "DistributedOptimizer")

    def _hvd_reduce(self, grads: list) -> list:
        return allreduce_gradients(grads, _GRADS_NAME, self._hvd_compression, self._hvd_op,
                                   self._hvd_predivide)

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """Reduce ``grads`` across ranks (unless accumulating), then apply them."""
        grads = list(grads)
        if not self._hvd_checked and grads:
            self._hvd_check(grads, trainable_variables)
        if not self._hvd_accumulating and grads:
            grads = self._hvd_reduce(grads)
        return super().apply(grads, trainable_variables)

    def _clip_gradients(self, grads: list) -> list:
        # Keras calls this exactly once per real update, with the averaged
        # accumulated gradients: the one place to reduce when accumulating.
        if self._hvd_accumulating:
            grads = self._hvd_reduce(list(grads))
        return super()._clip_gradients(grads)

    def get_config(self) -> dict:
        """The wrapped optimizer's config plus this wrapper's settings."""
        config = super().get_config()
        config[_CONFIG_KEY] = {
            "compression": compression_name(self._hvd_compression),
            "op": int(self._hvd_op),
            "gradient_predivide_factor": self._hvd_predivide,
        }
        return config


def distributed_class(base: type) -> type:
    """The registered ``Distributed<Base>`` subclass of a Keras optimizer class."""
    cls = _CLASSES.get(base)
    if cls is not None:
        return cls
    qualified = base.__module__.startswith("keras")
    name = f"Distributed{base.__name__}"
    cls = type(name, (_DistributedMixin, base), {
        "__module__": __name__,
        "__doc__": f"{base.__name__} whose gradients are reduced across hvd_spark ranks.",
    })
    registered = name if qualified else f"{name}.{base.__module__}"
    _CLASSES[base] = keras.saving.register_keras_serializable(
        package="hvd_spark", name=registered)(cls)
    return _CLASSES[base]


def DistributedOptimizer(  # noqa: N802 - Horovod's public name
    optimizer: keras.optimizers.Optimizer, name: str | None = None,
    device_dense: str = "", device_sparse: str = "",
    compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1, op: ReduceOp = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so gradients are reduced across ranks before each update.

    Wrap before training: the new optimizer is rebuilt from ``optimizer.get_config()``
    (its slots start empty). Scale the learning rate by ``size()`` as usual.

    Args:
        optimizer: A ``keras.optimizers.Optimizer`` (``tf.keras.optimizers.*`` in TF 2.16+).
        name: Optional new name of the optimizer.
        device_dense, device_sparse: Accepted for Horovod compatibility; ignored.
        compression: ``Compression.none`` or ``Compression.fp16``.
        sparse_as_dense: Accepted for compatibility: sparse gradients are always densified.
        backward_passes_per_step: Accumulate this many batches locally, then reduce
            and apply once (Keras's ``gradient_accumulation_steps``).
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: Divide by this before summing and by
            ``size / factor`` after (Average only).

    Returns:
        An optimizer of class ``Distributed<OptimizerClass>``, usable in ``model.compile``.

    Raises:
        ConfigError: ``optimizer`` is not a Keras 3 optimizer, or a bad setting.
    """
    del device_dense, device_sparse, sparse_as_dense
    if isinstance(optimizer, _DistributedMixin):
        raise ConfigError("DistributedOptimizer: this optimizer is already distributed")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(
            f"DistributedOptimizer expects a Keras 3 optimizer (keras.optimizers.Optimizer, "
            f"e.g. tf.keras.optimizers.SGD), got {type(optimizer).__module__}."
            f"{type(optimizer).__name__}; for a custom training loop with another optimizer "
            "use hvd.DistributedGradientTape instead")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ConfigError(
            "DistributedOptimizer: wrap the inner optimizer, then pass it to "
            "LossScaleOptimizer (or use mixed precision through model.compile)")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ConfigError(
            f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
    op = check_reduce_args(op, gradient_predivide_factor, "DistributedOptimizer")
    compression_name(compression)  # raises for compressors that cannot be saved
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        if config.get("gradient_accumulation_steps"):
            raise ConfigError(
                "DistributedOptimizer: set backward_passes_per_step or the optimizer's "
                "gradient_accumulation_steps, not both")
        config["gradient_accumulation_steps"] = backward_passes_per_step
    if name is not None:
        config["name"] = name
    config[_CONFIG_KEY] = {
        "compression": compression_name(compression),
        "op": int(op),
        "gradient_predivide_factor": float(gradient_predivide_factor),
    }
    return distributed_class(type(optimizer)).from_config(config)


def _register_builtins() -> None:
    """Register the Distributed versions of Keras's optimizers, so saved models load."""
    for obj in vars(keras.optimizers).values():
        if (inspect.isclass(obj) and issubclass(obj, keras.optimizers.Optimizer)
                and obj is not keras.optimizers.Optimizer
                and obj is not keras.optimizers.LossScaleOptimizer):
            distributed_class(obj)


_register_builtins()
