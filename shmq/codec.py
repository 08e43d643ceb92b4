"""Encoding of messages that are not a single plain array.

A tree (tuple/list/dict, nested) of arrays and small Python values is
pickled with protocol 5; every array leaves the pickle stream as an
out-of-band buffer, so its bytes are copied exactly once, straight into the
ring, and are never pickled.  The stream itself only carries structure,
dtypes, shapes and the small extras.
"""

from __future__ import annotations

import io
import pickle
import sys

import numpy as np

__all__ = ["encode", "array_from_buffer", "check_array"]


def check_array(arr: np.ndarray) -> None:
    """Refuse what cannot travel as raw bytes, before anything is claimed."""
    if arr.dtype.hasobject:
        raise TypeError(
            f"shmq sends arrays as raw bytes and cannot send dtype {arr.dtype} (shape "
            f"{arr.shape}): its elements are references to Python objects. Convert it to a "
            f"numeric or fixed-width string dtype (e.g. arr.astype('U')), or send a list")


def array_from_buffer(buf, dtype, shape, order):
    """Rebuild an array over ``buf`` without copying (pickle reducer)."""
    return np.frombuffer(buf, dtype=dtype).reshape(shape, order=order)


def _tensor_from_buffer(buf, dtype, shape):
    import torch

    return torch.from_numpy(array_from_buffer(buf, dtype, shape, "C"))


class _OutOfBandPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, np.ndarray):
            check_array(obj)
            if obj.flags.c_contiguous:
                order = "C"
            elif obj.flags.f_contiguous:
                order = "F"
            else:
                # A strided view has no single buffer: one contiguous copy.
                obj, order = np.ascontiguousarray(obj), "C"
            return array_from_buffer, (pickle.PickleBuffer(obj), obj.dtype, obj.shape, order)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            arr = _tensor_as_array(torch, obj)
            return _tensor_from_buffer, (pickle.PickleBuffer(arr), arr.dtype, arr.shape)
        return NotImplemented


def _tensor_as_array(torch, t) -> np.ndarray:
    if t.device.type != "cpu":
        raise TypeError(f"shmq carries CPU memory; move the {t.device} tensor with .cpu() first")
    if t.requires_grad:
        t = t.detach()
    return np.ascontiguousarray(t.resolve_conj().resolve_neg().numpy())


def encode(obj) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """(pickle stream, out-of-band buffers) for ``obj``."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _OutOfBandPickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
    return stream.getvalue(), buffers
