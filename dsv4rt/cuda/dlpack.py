"""DLPack capsules for DeviceArray (legacy unversioned protocol, what CuPy's from_dlpack accepts)."""
from __future__ import annotations

import ctypes

import numpy as np


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int), ("dtype", _DType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_CODES = {"i": 0, "u": 1, "f": 2, "b": 1, "V": 1}  # ml_dtypes (bf16, fp8) travel as unsigned ints
_alive: dict[int, tuple] = {}  # what a capsule's consumer may still read, until it calls the deleter


@_DELETER
def _delete(managed):
    _alive.pop(ctypes.addressof(managed.contents), None)


_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


# The raw PyObject*: a py_object argument would take a new reference to a capsule being freed.
@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_gone(capsule):
    """A capsule nobody consumed still owns its tensor."""
    if _api.PyCapsule_IsValid(capsule, b"dltensor"):
        addr = _api.PyCapsule_GetPointer(capsule, b"dltensor")
        _alive.pop(addr, None)


def capsule(array) -> object:
    dtype = np.dtype(array.dtype)
    if dtype.kind not in _CODES:
        raise TypeError(f"no DLPack code for {dtype}")
    shape = (ctypes.c_int64 * len(array.shape))(*array.shape)
    managed = _Managed()
    managed.dl_tensor = _Tensor(array.ptr, _Device(2, array.__dlpack_device__()[1]), len(array.shape),
                                _DType(_CODES[dtype.kind], dtype.itemsize * 8, 1), shape, None, 0)
    managed.deleter = _delete
    addr = ctypes.addressof(managed)
    _alive[addr] = (managed, shape, array)
    return _api.PyCapsule_New(addr, b"dltensor", ctypes.cast(_capsule_gone, ctypes.c_void_p))
