"""Encoding of messages that are not a single plain array.

A tree (tuple/list/dict, nested) of arrays and small Python values is
pickled with protocol 5; every array leaves the pickle stream as an
out-of-band buffer, so its bytes are copied exactly once, straight into the
ring, and are never pickled.  The stream itself only carries structure,
dtypes, shapes and the small extras.

What comes back is what went in, or put() refuses it (TypeError, before
anything is claimed):
- np.ndarray: same dtype, shape (0-d stays 0-d), bytes; Fortran order kept.
  Zero-itemsize dtypes (np.dtype([]), "V0") too: they carry no bytes.
- np.matrix, np.recarray, np.char.chararray: the same subclass (they hold
  nothing but the array).
- np.ma.MaskedArray: data, mask (nomask stays nomask), fill_value and
  hard_mask; data and mask travel as out-of-band arrays.  np.ma.masked
  stays the singleton.
- np.memmap: its contents, as a plain np.ndarray (the mapping does not
  travel; this is what a memmap of a dataset is sent for).
- any other ndarray subclass is refused: it would lose its type and
  attributes.  Send np.asarray(x), or its parts.
- torch.Tensor (CPU): a tensor of the same dtype and shape (0-d stays 0-d).
"""

from __future__ import annotations

import io
import pickle
import sys
import warnings

import numpy as np

__all__ = ["encode", "array_from_buffer", "subclass_from_buffer", "masked_from_parts", "check_array"]


def check_array(arr: np.ndarray) -> None:
    """Refuse what cannot travel as raw bytes, before anything is claimed."""
    if arr.dtype.hasobject:
        raise TypeError(
            f"shmq sends arrays as raw bytes and cannot send dtype {arr.dtype} (shape "
            f"{arr.shape}): its elements are references to Python objects. Convert it to a "
            f"numeric or fixed-width string dtype (e.g. arr.astype('U')), or send a list")


def array_from_buffer(buf, dtype, shape, order):
    """Rebuild an array over ``buf`` without copying (pickle reducer)."""
    if dtype.itemsize == 0:
        # No bytes to view (np.frombuffer refuses a zero itemsize), and none
        # needed: every element is empty.
        return np.empty(shape, dtype, order=order)
    return np.frombuffer(buf, dtype=dtype).reshape(shape, order=order)


def subclass_from_buffer(buf, dtype, shape, order, kind):
    """array_from_buffer, viewed as one of the stateless ndarray subclasses,
    named by `kind` (a key of _STATELESS_SUBCLASSES)."""
    cls = _STATELESS_SUBCLASSES.get(kind)
    if cls is None:
        raise TypeError(f"this process's numpy has no {kind!r} array class to rebuild a "
                        f"received one (the sender's numpy is older?)")
    return array_from_buffer(buf, dtype, shape, order).view(cls)


def masked_from_parts(data, mask, fill_value, hard_mask):
    """Rebuild an np.ma.MaskedArray from arrays that travelled out of band."""
    return np.ma.MaskedArray(data, mask=mask, fill_value=fill_value, hard_mask=hard_mask,
                             copy=False, shrink=False)


def _tensor_from_buffer(buf, dtype, shape):
    import torch

    return torch.from_numpy(array_from_buffer(buf, dtype, shape, "C"))


def _chararray_class():
    """np.char.chararray, or None once numpy has removed it.  numpy 2.5
    deprecates the class with a warning on attribute access; shmq only
    recognises the type (it never makes one of its own accord), so importing
    shmq must not warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return getattr(np.char, "chararray", None)


# ndarray subclasses that hold nothing but the array: a view restores them.
# They travel by these names, not pickled by reference: numpy 2.5 warns on
# every lookup of np.char.chararray, which pickling by reference would do.
_STATELESS_SUBCLASSES = {name: cls for name, cls in (
    ("matrix", np.matrix), ("recarray", np.recarray), ("chararray", _chararray_class()))
    if cls is not None}
_SUBCLASS_NAMES = {cls: name for name, cls in _STATELESS_SUBCLASSES.items()}


def _c_contiguous(arr: np.ndarray) -> np.ndarray:
    # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _buffer_reduce(obj: np.ndarray):
    """(array_from_buffer, its arguments) for a plain np.ndarray: its
    memory as one out-of-band buffer."""
    if obj.flags.c_contiguous:
        order = "C"
    elif obj.flags.f_contiguous:
        order = "F"
    else:
        # A strided view has no single buffer: one contiguous copy.
        obj, order = _c_contiguous(obj), "C"
    try:
        buf = pickle.PickleBuffer(obj)
    except ValueError:
        # numpy exports no buffer for datetime/timedelta dtypes (or structs
        # holding them): export the same bytes as uint8.  obj is
        # contiguous, so ravel(order="K") is a view, 0-d included.
        buf = pickle.PickleBuffer(obj.ravel(order="K").view(np.uint8))
    return array_from_buffer, (buf, obj.dtype, obj.shape, order)


def _refuse_subclass(obj: np.ndarray):
    cls = type(obj)
    raise TypeError(
        f"shmq cannot send a {cls.__module__}.{cls.__qualname__} (an np.ndarray subclass, "
        f"shape {obj.shape}, dtype {obj.dtype}): it would arrive as a plain np.ndarray without "
        f"its type and attributes. Send np.asarray(x) to send the data alone, or send its parts. "
        f"Subclasses that travel: np.matrix, np.recarray, np.char.chararray, np.ma.MaskedArray, "
        f"np.memmap (arrives as np.ndarray)")


_ndarray = np.ndarray  # module globals: this runs once per object pickled


class _OutOfBandPickler(pickle.Pickler):
    extra_reduce = None  # encode(reduce=...)

    def reducer_override(self, obj):
        if type(obj) is _ndarray:  # the hot case first, without a call
            if obj.dtype.hasobject:
                check_array(obj)
            return _buffer_reduce(obj)
        if isinstance(obj, _ndarray):
            return _reduce_subclass(obj)
        torch = sys.modules.get("torch")
        # (a torch still being imported, by another thread, has no Tensor yet)
        if torch is not None and isinstance(obj, getattr(torch, "Tensor", ())):
            arr = _tensor_as_array(torch, obj)
            return _tensor_from_buffer, (pickle.PickleBuffer(arr), arr.dtype, arr.shape)
        if self.extra_reduce is not None:
            return self.extra_reduce(obj)
        return NotImplemented


def _reduce_subclass(obj: np.ndarray):
    cls = type(obj)
    if cls is np.memmap or cls in _SUBCLASS_NAMES:
        check_array(obj)
        base = obj.view(np.ndarray)
        if cls is np.memmap:
            return _buffer_reduce(base)  # its contents, as a plain array
        return subclass_from_buffer, _buffer_reduce(base)[1] + (_SUBCLASS_NAMES[cls],)
    if cls is np.ma.MaskedArray:
        # data and mask are plain arrays (or subclasses above), so they come
        # back through reducer_override: out of band.
        return masked_from_parts, (np.ma.getdata(obj), np.ma.getmask(obj), obj._fill_value,
                                   obj._hardmask)
    if cls is np.ma.core.MaskedConstant:
        return NotImplemented  # numpy's reduce: the np.ma.masked singleton
    _refuse_subclass(obj)


def _tensor_as_array(torch, t) -> np.ndarray:
    if t.device.type != "cpu":
        raise TypeError(f"shmq carries CPU memory; move the {t.device} tensor with .cpu() first")
    if t.requires_grad:
        t = t.detach()
    return _c_contiguous(t.resolve_conj().resolve_neg().numpy())


def encode(obj, reduce=None) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """(pickle stream, out-of-band buffers) for ``obj``.  reduce: tried for
    every object that is not an array or tensor, as pickle's
    reducer_override (return NotImplemented to pickle it as usual); lets a
    caller whose peers are forked children name what pickle cannot find."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    pickler = _OutOfBandPickler(stream, protocol=5, buffer_callback=buffers.append)
    if reduce is not None:
        pickler.extra_reduce = reduce
    pickler.dump(obj)
    return stream.getvalue(), buffers
