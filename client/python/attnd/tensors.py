"""Tensors on the wire: numpy (or torch, or DLPack) arrays to and from attnd.v1 ``Tensor``
messages (:func:`to_tensor`, :func:`from_tensor`, :func:`as_numpy`, :func:`to_torch`), and fp8
queries (:class:`Fp8Tensor`, :func:`quantize_fp8`)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Tuple

import ml_dtypes
import numpy as np

from .v1 import attention_pb2 as pb

__all__ = ["Fp8Tensor", "as_numpy", "from_tensor", "quantize_fp8", "to_tensor", "to_torch"]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_NAME_OF = {np.dtype(np.float32): "FP32", np.dtype(np.float16): "FP16", _BF16: "BF16"}
_DTYPE_OF = {name: dt for dt, name in _NAME_OF.items()}
_DTYPE_OF["FP8_E4M3"] = _FP8  # keys as an fp8 cache holds them (exports), with their scales


def _native(dtype: np.dtype) -> np.dtype:
    return dtype if dtype.byteorder in "=|" else dtype.newbyteorder("=")


def _wire_name(dtype: np.dtype, uint16_as_bf16: bool) -> str:
    """The wire datatype of a (native byte order) numpy dtype; TypeError if it has none."""
    if dtype == np.uint16 and uint16_as_bf16:
        return "BF16"
    if dtype in _NAME_OF:
        return _NAME_OF[dtype]
    raise TypeError(
        f"unsupported tensor dtype {dtype}: use float32, float16 or ml_dtypes.bfloat16"
        + (" (or uint16 bf16 bits with uint16_as_bf16=True)" if dtype == np.uint16 else "")
    )


def as_numpy(x) -> np.ndarray:
    """``x`` as a numpy array, sharing memory where it can: a CPU torch tensor (any layout;
    torch.bfloat16 as ml_dtypes.bfloat16, reinterpreting the same bytes), any other object
    offering DLPack (``__dlpack__``), or anything np.asarray takes. A tensor that requires grad
    is detached (its values are what is sent); one on a GPU raises TypeError naming its device
    (move it first: attnd never copies device memory behind a caller's back)."""
    if isinstance(x, np.ndarray):
        return x
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise TypeError(f"a torch tensor on {x.device}: attnd takes CPU tensors (.cpu())")
        if x.requires_grad:
            x = x.detach()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    if hasattr(x, "__dlpack__") and not isinstance(x, (list, tuple)):
        return np.from_dlpack(x)
    return np.asarray(x)


def to_torch(a: np.ndarray):
    """A numpy array as a CPU torch tensor sharing its memory (ml_dtypes.bfloat16 as
    torch.bfloat16, the same bytes)."""
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype == np.uint16:  # raw bf16 bits (uint16_as_bf16): torch before 2.3 has no uint16
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def to_tensor(array, *, uint16_as_bf16: bool = False) -> pb.Tensor:
    """A numpy array (or a CPU torch tensor, or any DLPack array: see :func:`as_numpy`) as a wire
    Tensor (little-endian, row-major, no padding).

    float32 -> FP32, float16 -> FP16, bfloat16 (ml_dtypes or torch) -> BF16, and uint16 -> BF16
    (the raw bits) when ``uint16_as_bf16``. Any byte order and memory layout is accepted. Raises
    TypeError for other dtypes.
    """
    a = as_numpy(array)
    dt = _native(a.dtype)
    name = _wire_name(dt, uint16_as_bf16)
    size = dt.itemsize
    native = np.ascontiguousarray(a, dtype=dt)
    data = native.view(f"=u{size}").astype(f"<u{size}", copy=False).tobytes()
    return pb.Tensor(datatype=name, shape=list(a.shape), data=data)


def from_tensor(tensor: pb.Tensor, *, uint16_as_bf16: bool = False,
                dequantize: bool = False) -> np.ndarray:
    """A wire Tensor as a (writable) numpy array; BF16 as uint16 bits when ``uint16_as_bf16``.
    FP8_E4M3 (an fp8 server's exported keys) comes as ``ml_dtypes.float8_e4m3fn`` codes, or with
    ``dequantize=True`` as float32 values: each code times its scale from ``tensor.scales``."""
    if tensor.datatype == "FP8_E4M3" and dequantize:
        codes = from_tensor(tensor).astype(np.float32)
        scales = from_tensor(tensor.scales)
        if scales.ndim != codes.ndim or codes.shape[-1] % max(scales.shape[-1], 1):
            raise ValueError(f"FP8_E4M3 {list(codes.shape)}: scales {list(scales.shape)}")
        return codes * np.repeat(scales, codes.shape[-1] // scales.shape[-1], axis=-1)
    dt = _DTYPE_OF.get(tensor.datatype)
    if dt is None:
        raise ValueError(f"unsupported tensor datatype {tensor.datatype!r}")
    shape = tuple(int(d) for d in tensor.shape)
    size = dt.itemsize
    want = int(np.prod(shape, dtype=np.int64)) * size
    if len(tensor.data) != want:
        raise ValueError(
            f"tensor {tensor.datatype}{list(shape)}: {len(tensor.data)} bytes, expected {want}"
        )
    bits = np.frombuffer(tensor.data, dtype=f"<u{size}").astype(f"=u{size}")  # a writable copy
    if tensor.datatype == "BF16" and uint16_as_bf16:
        return bits.reshape(shape)
    return bits.view(dt).reshape(shape)


def _check_dtype(dtype: np.dtype) -> None:
    dt = _native(dtype)
    if dt not in _NAME_OF and dt != np.uint16:
        _wire_name(dt, False)  # raises the usual TypeError


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """A query as FP8_E4M3 codes with one float32 scale per row of its last axis (per token and
    head: docs/numerics.md), a quarter of float32's bytes on the wire; the server dequantises it as
    code x scale in float32. Make one with :func:`quantize_fp8`; pass it as q_latent, q_nope,
    q_rope or index_q (the other tensors keep their datatype; the output comes back as BF16).
    A layer call with ``out_datatype="FP8_E4M3"`` returns its output as one (power-of-two
    scales)."""

    codes: np.ndarray  # ml_dtypes.float8_e4m3fn [..., D]
    scales: np.ndarray  # float32 [..., 1]

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.codes.shape)

    def dequantize(self) -> np.ndarray:
        """The values the server attends with: code x scale, in float32."""
        return self.codes.astype(np.float32) * self.scales.astype(np.float32)

    def to_tensor(self) -> pb.Tensor:
        t = pb.Tensor(datatype="FP8_E4M3", shape=list(self.codes.shape),
                      data=np.ascontiguousarray(self.codes).view(np.uint8).tobytes())
        t.scales.CopyFrom(to_tensor(np.ascontiguousarray(self.scales, dtype=np.float32)))
        return t


def quantize_fp8(x) -> Fp8Tensor:
    """A query [..., D] (any float array, torch tensor or DLPack array) as FP8_E4M3 with one
    scale per row of the last axis: scale = max |x| / 448 over the row (1 for an all-zero row),
    codes = x / scale rounded to nearest e4m3."""
    a = np.asarray(as_numpy(x), dtype=np.float32)
    if a.ndim < 1 or a.shape[-1] == 0:
        raise ValueError(f"quantize_fp8: needs [..., D] with D > 0, got {list(a.shape)}")
    amax = np.abs(a).max(axis=-1, keepdims=True)
    if not np.isfinite(amax).all():
        raise ValueError("quantize_fp8: the query holds NaN or infinity")
    # The smallest normal float32 at least, so that a row of tiny values keeps a nonzero scale.
    scales = np.where(amax > 0, np.maximum(amax / np.float32(448.0), np.finfo(np.float32).tiny),
                      np.float32(1.0)).astype(np.float32)
    codes = np.clip(a / scales, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return Fp8Tensor(codes=codes, scales=scales)
