"""Gradient compression on the wire: ``Compression.none`` and ``Compression.fp16``."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class Compressor:
    """Turns a tensor into what travels and back; subclasses are used as classes."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """Return the tensor to send and the context ``decompress`` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Undo ``compress`` on the reduced tensor."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16, halving float32 traffic."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tf.cast(tensor, ctx) if ctx is not None else tensor


class Compression:
    """The compressors, by the names Horovod users know."""

    none = NoneCompressor
    fp16 = FP16Compressor


def compression_name(compression: type[Compressor]) -> str:
    """``"none"``/``"fp16"``, for saving an optimizer's config."""
    for name in ("none", "fp16"):
        if compression is getattr(Compression, name):
            return name
    raise ValueError(f"compression {compression!r} has no saved name")
