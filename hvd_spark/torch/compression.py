"""Gradient compression: shrink tensors before they go on the wire, restore them after."""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Interface: ``compress`` returns ``(tensor_to_send, ctx)``; ``decompress`` undoes it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to send and what ``decompress`` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the received tensor in its original form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors unchanged (in-place allreduce, no copies)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Send wider floating-point tensors as ``wire_dtype``; other tensors unchanged."""

    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.is_floating_point() and tensor.dtype != cls.wire_dtype:
            # ``to`` is differentiable: a compressed allreduce keeps its gradient (Horovod's too).
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Send floating-point tensors as float16 (half the bytes; ~3 significant digits)."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Send floating-point tensors as bfloat16 (float32's range, ~2 significant digits)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The compressors by name, as in Horovod: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
