"""``DistributedOptimizer`` for Keras 3 optimizers, and ``load_model``.

The wrapper is a subclass of the optimizer's own class, made on the fly
(``DistributedSGD``, ``DistributedAdam``, ...), so ``model.compile``, saving and every
hyperparameter keep working. It reduces the gradients across ranks in fused
collectives before the optimizer uses them, inside the compiled ``train_function``
of ``model.fit`` as well as eagerly:

- ``backward_passes_per_step == 1``: in ``apply`` (what ``apply_gradients`` and
  ``model.fit`` call), before loss-scale unscaling, clipping and the update.
- ``backward_passes_per_step == n > 1``: Keras's own ``gradient_accumulation_steps=n``
  accumulates locally and the reduction runs only on the n-th step, just before
  clipping. Keras hands over the *mean* of the n gradients; as in Horovod, the update
  uses their *sum* unless ``average_aggregated_gradients=True``.

Saving: each class is registered with Keras as ``hvd_spark>Distributed<Name>``; the
built-in optimizers are registered when this module is imported, so
``keras.models.load_model`` (or ``load_model`` here) works after
``import hvd_spark.tensorflow``. For a custom optimizer class, call
``DistributedOptimizer`` on one instance (or pass ``custom_objects``) before loading.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import keras
import tensorflow as tf

from hvd_spark import collectives as C
from hvd_spark.collectives.elastic import is_elastic
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.errors import ConfigError
from hvd_spark.tensorflow.compression import Compression, Compressor, compression_name
from hvd_spark.tensorflow.functions import check_same_everywhere
from hvd_spark.tensorflow.gradients import GradientReducer, check_reduce_args, make_groups
from hvd_spark.tensorflow.legacy_optimizer import LegacyDistributedOptimizer, wrap_legacy

_CONFIG_KEY = "hvd_spark"
_GRADS_NAME = "DistributedOptimizer.grads"
_CLASSES: dict[type, type] = {}
# Settings that survive get_config (a process set or lists of variables do not).
_SAVED = ("compression", "op", "gradient_predivide_factor", "sparse_as_dense",
          "average_aggregated_gradients", "scale_local_gradients")


class _Seen:
    """The variables of the current apply, out of sight of Keras's variable tracking.

    (An optimizer attribute holding a list of variables would make them optimizer
    variables, saved and counted with its own.)
    """

    variables: list | None = None
    reduced: bool = False  # set by _compute_gradients for the next apply


class _DistributedMixin:
    """Reduces gradients across ranks before the wrapped optimizer class uses them."""

    def __init__(self, *args: Any, hvd_spark: dict | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = dict(hvd_spark or {})
        groups = settings.get("groups")
        self._hvd_settings = settings
        self._hvd_reducer = GradientReducer(
            _GRADS_NAME, getattr(Compression, settings.get("compression", "none")),
            ReduceOp(settings.get("op", int(ReduceOp.Average))),
            float(settings.get("gradient_predivide_factor", 1.0)),
            bool(settings.get("sparse_as_dense", False)), groups,
            settings.get("process_set", global_process_set),
            bool(settings.get("scale_local_gradients", True)))
        self._hvd_average_aggregated = bool(settings.get("average_aggregated_gradients", False))
        self._hvd_accumulating = bool(self.gradient_accumulation_steps)
        self._hvd_checked = False
        self._hvd_seen = _Seen()

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (no allreduce), as Horovod's optimizer."""
        self._hvd_reducer.register_local_source(var)

    def _hvd_check(self, grads: list, variables: list | None) -> None:
        # Once, at the first (trace of) apply, which every rank reaches at the same
        # step: a different model becomes a clear error here, not a fused-buffer
        # size mismatch deep inside a graph error. Paths may differ between ranks
        # (Keras numbers layer names per process), so only shapes and dtypes count.
        self._hvd_checked = True
        ps = self._hvd_reducer.process_set
        if C.size() == 1 or (ps is not global_process_set and not ps.included()):
            return
        if is_elastic():
            # A rank that joins later traces alone; a collective here would wait for
            # ranks that traced long ago. The elastic state's sync checks shapes instead.
            return
        variables = variables if variables is not None else self._trainable_variables
        signature = [(tuple(v.shape), str(v.dtype)) for g, v in zip(grads, variables)
                     if g is not None and not self._hvd_reducer.is_local(v)]
        check_same_everywhere(signature, "DistributedOptimizer.check", "DistributedOptimizer",
                              ps)

    def _hvd_reduce(self, grads: list) -> list:
        variables = self._hvd_seen.variables
        if variables is None or len(variables) != len(grads):
            variables = [None] * len(grads)
        return self._hvd_reducer.reduce(grads, variables)

    def _compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list:
        """Horovod's (Keras 2) hook: ``(gradient, variable)`` pairs, reduced across ranks.

        ``loss`` is a tensor recorded on ``tape`` or a callable. The next
        ``apply_gradients`` does not reduce these gradients again.
        """
        var_list = list(var_list)
        if tape is None:
            tape = tf.GradientTape()
            with tape:
                tape.watch(var_list)
                loss = loss() if callable(loss) else loss
        elif callable(loss):
            with tape:
                loss = loss()
        grads = tape.gradient(loss, var_list)
        if not self._hvd_accumulating:
            self._hvd_seen.variables = var_list
            grads = self._hvd_reduce(list(grads))
            self._hvd_seen.reduced = True
        return list(zip(grads, var_list))

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """Reduce ``grads`` across ranks (unless accumulating), then apply them."""
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        self._hvd_seen.variables = trainable_variables
        reduced, self._hvd_seen.reduced = self._hvd_seen.reduced, False
        if not self._hvd_checked and grads:
            self._hvd_check(grads, trainable_variables)
        if not self._hvd_accumulating and grads and not reduced:
            grads = self._hvd_reduce(grads)
        return super().apply(grads, trainable_variables)

    def reduce_for_loss_scale(self, grads: Any, trainable_variables: Any = None) -> list:
        """Reduce ``grads`` for the ``LossScaleOptimizer`` around this one, before its check.

        Keras's ``LossScaleOptimizer`` skips the inner optimizer's ``apply`` when its
        gradients are not finite. Each rank would decide on its own gradients: the rank
        that overflowed would skip the allreduce its peers wait in, and the replicas
        would part. Reduced first (Horovod reduces inside Keras 2's
        ``compute_gradients``, before the same check), every rank checks the same
        gradients and skips the same steps; the next ``apply`` does not reduce again.

        Raises:
            ConfigError: ``backward_passes_per_step > 1`` (the reduction runs on the
                accumulated gradients, inside the step a rank may skip alone).
        """
        if self._hvd_accumulating:
            raise ConfigError(
                "LossScaleOptimizer around a DistributedOptimizer with "
                "backward_passes_per_step > 1 is not supported: a rank whose gradients "
                "overflow would skip the accumulated allreduce alone; use "
                "backward_passes_per_step=1 or bfloat16 (mixed_bfloat16 needs no loss scale)")
        grads = list(grads)
        variables = None if trainable_variables is None else list(trainable_variables)
        self._hvd_seen.variables = variables
        if not self._hvd_checked and grads:
            self._hvd_check(grads, variables)
        grads = self._hvd_reduce(grads)
        self._hvd_seen.reduced = True
        return grads

    def _clip_gradients(self, grads: list) -> list:
        # Keras calls this exactly once per real update, with the mean of the
        # accumulated gradients: the one place to reduce when accumulating.
        if self._hvd_accumulating:
            grads = list(grads)
            if not self._hvd_average_aggregated:
                steps = self.gradient_accumulation_steps  # Horovod applies the sum
                grads = [None if g is None else g * tf.cast(steps, g.dtype) for g in grads]
            grads = self._hvd_reduce(grads)
        return super()._clip_gradients(grads)

    def get_config(self) -> dict:
        """The wrapped optimizer's config plus this wrapper's (serialisable) settings."""
        config = super().get_config()
        config[_CONFIG_KEY] = _saved_settings(self._hvd_settings)
        return config


def _saved_settings(settings: dict) -> dict:
    saved = {k: settings[k] for k in _SAVED if k in settings}
    if isinstance(settings.get("groups"), int):
        saved["groups"] = settings["groups"]
    return saved


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
    gradient_predivide_factor: float = 1.0, op: ReduceOp = ReduceOp.Average,
    backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
    num_groups: int = 0, groups: Any = None, process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True, use_locking: bool = False,
) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so gradients are reduced across ranks before each update.

    Wrap before training: the new optimizer is rebuilt from ``optimizer.get_config()``
    (its slots start empty). A TF1 ``tf.compat.v1.train.Optimizer`` (graphs) is wrapped
    instead: its ``compute_gradients``/``minimize`` reduce the gradients. Scale the
    learning rate by ``size()`` as usual. The arguments are those of Horovod's
    ``horovod.tensorflow.keras.DistributedOptimizer``, in its order.

    Args:
        optimizer: A ``keras.optimizers.Optimizer`` (``tf.keras.optimizers.*`` in TF 2.16+).
        name: Optional new name of the optimizer.
        device_dense: Accepted for Horovod compatibility; ignored.
        device_sparse: Accepted for Horovod compatibility; ignored.
        compression: ``Compression.none`` or ``Compression.fp16``.
        sparse_as_dense: Densify ``tf.IndexedSlices`` gradients (else they are allgathered).
        gradient_predivide_factor: Divide by this before summing and by
            ``size / factor`` after (Average only).
        op: ``Average`` (default), ``Sum`` or ``Adasum``.
        backward_passes_per_step: Accumulate this many batches locally, then reduce
            and apply once (Keras's ``gradient_accumulation_steps``).
        average_aggregated_gradients: With ``backward_passes_per_step > 1``, apply the
            mean of the accumulated gradients instead of their sum (Horovod's default).
        num_groups: Deprecated: split the gradients into this many fused operations.
        groups: An int (as ``num_groups``) or lists of variables fused together.
        process_set: The ranks that average their gradients.
        scale_local_gradients: Divide the gradients of ``register_local_var`` variables
            by the set's size.
        use_locking: ``horovod.tensorflow``'s flag for TF1 optimizers (keyword here).

    Returns:
        An optimizer of class ``Distributed<OptimizerClass>``, usable in ``model.compile``.

    Raises:
        ConfigError: ``optimizer`` is neither a Keras 3 nor a TF1 optimizer, or a bad
            setting.
    """
    del device_dense, device_sparse
    if isinstance(optimizer, (_DistributedMixin, LegacyDistributedOptimizer)):
        raise ConfigError("DistributedOptimizer: this optimizer is already distributed")
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        reducer = GradientReducer(
            "DistributedOptimizer.grads", compression, op, float(gradient_predivide_factor),
            bool(sparse_as_dense), make_groups(num_groups, groups, "DistributedOptimizer"),
            process_set, bool(scale_local_gradients))
        return wrap_legacy(optimizer, reducer, name, use_locking, backward_passes_per_step)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(
            f"DistributedOptimizer expects a Keras 3 optimizer (keras.optimizers.Optimizer, "
            f"e.g. tf.keras.optimizers.SGD) or a TF1 tf.compat.v1.train.Optimizer, got "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}; for a custom training "
            "loop with another optimizer use hvd.DistributedGradientTape instead")
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
        "sparse_as_dense": bool(sparse_as_dense),
        "average_aggregated_gradients": bool(average_aggregated_gradients),
        "groups": make_groups(num_groups, groups, "DistributedOptimizer"),
        "process_set": process_set,
        "scale_local_gradients": bool(scale_local_gradients),
    }
    return distributed_class(type(optimizer)).from_config(config)


def PartialDistributedOptimizer(  # noqa: N802 - Horovod's public name
    optimizer: keras.optimizers.Optimizer, name: str | None = None,
    device_dense: str = "", device_sparse: str = "",
    compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0, op: ReduceOp = ReduceOp.Average,
    backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
    groups: Any = None, process_set: ProcessSet = global_process_set,
    local_layers: Any = None, scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """A ``DistributedOptimizer`` whose ``local_layers``' weights keep local gradients.

    The other arguments are ``DistributedOptimizer``'s.

    Args:
        local_layers: A Keras layer or a list of them (model-parallel parts).
    """
    opt = DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
        0, groups, process_set, scale_local_gradients)
    layers = local_layers if isinstance(local_layers, (list, tuple)) else (
        [] if local_layers is None else [local_layers])
    for layer in layers:
        if not hasattr(layer, "trainable_weights"):
            raise ConfigError(
                f"PartialDistributedOptimizer: local_layers must be Keras layers, got "
                f"{type(layer).__name__}")
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt


def load_model(filepath: Any, custom_optimizers: list[type] | None = None,
               custom_objects: dict | None = None,
               compression: type[Compressor] = Compression.none,
               legacy_opts: bool = False) -> keras.Model:
    """Load a Keras model whose optimizer is distributed (wrapped if it was saved plain).

    Args:
        filepath: A ``.keras`` file (or what ``keras.models.load_model`` accepts).
        custom_optimizers: Optimizer classes of the saved model that are not Keras's own.
        custom_objects: As ``keras.models.load_model``.
        compression: Compression of a newly wrapped optimizer.
        legacy_opts: Horovod's flag for ``tf.keras.optimizers.legacy``; must be False
            (Keras 3 has no legacy optimizers).

    Raises:
        ConfigError: ``legacy_opts=True``.
    """
    if legacy_opts:
        raise ConfigError("load_model(legacy_opts=True): Keras 3 has no legacy optimizers")
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
        distributed_class(cls)
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not isinstance(optimizer, _DistributedMixin):
        wrapped = DistributedOptimizer(optimizer, compression=compression)
        if optimizer.built:
            wrapped.build(model.trainable_variables)
            for mine, saved in zip(wrapped.variables, optimizer.variables):
                mine.assign(saved)
        model.optimizer = wrapped
    return model


def _register_builtins() -> None:
    """Register the Distributed versions of Keras's optimizers, so saved models load."""
    for obj in vars(keras.optimizers).values():
        if (inspect.isclass(obj) and issubclass(obj, keras.optimizers.Optimizer)
                and obj is not keras.optimizers.Optimizer
                and obj is not keras.optimizers.LossScaleOptimizer):
            distributed_class(obj)


def _reduce_before_loss_scaling() -> None:
    """Make ``keras.mixed_precision.LossScaleOptimizer`` reduce a DistributedOptimizer's
    gradients before its finiteness check (see ``reduce_for_loss_scale``).

    ``model.compile`` wraps any optimizer of a ``mixed_float16`` model in Keras's own
    class, so the class itself must do it; it behaves as before around other optimizers.
    """
    cls = keras.optimizers.LossScaleOptimizer
    original = cls.apply
    if getattr(original, "_hvd_spark", False):
        return

    @functools.wraps(original)
    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        inner = getattr(self, "inner_optimizer", None)
        if not isinstance(inner, _DistributedMixin):
            return original(self, grads, trainable_variables)
        grads = inner.reduce_for_loss_scale(grads, trainable_variables)
        try:
            return original(self, grads, trainable_variables)
        finally:  # eagerly, a skipped step never reaches the inner apply that clears it
            inner._hvd_seen.reduced = False

    apply._hvd_spark = True  # type: ignore[attr-defined]
    cls.apply = apply


_register_builtins()
_reduce_before_loss_scaling()
