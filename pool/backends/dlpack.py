"""A torch tensor over raw memory on a device *named by the caller*, through a DLPack capsule.

``torch.as_tensor(obj_with___cuda_array_interface__)`` asks the driver which device a pointer
belongs to (``cudaPointerGetAttributes``) and, when that is not the device asked for, copies.
A VMM mapping of GPU i's memory that GPU j reads over NVLink reports device i, so that path
would silently copy. DLPack carries the device explicitly and torch builds the tensor on that
device without a query (``at::fromDLPack`` passes it as the target device; torch's own
symmetric-memory peer buffers do the same with ``for_blob(...).target_device``).

The capsule's deleter (a ctypes callback; ctypes takes the GIL itself) runs ``on_free`` once
torch frees the storage: the same lifetime hook as the ``__cuda_array_interface__`` owner.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import torch
import torch.utils.dlpack

KDL_CPU = 1
KDL_CUDA = 2
_KDL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

# Each live capsule's struct, shape array and hook, by the struct's address, until torch frees
# the storage; ``_lock`` because torch may free it on any thread.
_live: dict[int, tuple[_DLManagedTensor, ctypes.Array[ctypes.c_int64], Callable[[], None] | None]]
_live = {}
_lock = threading.Lock()


def _free(managed: ctypes._Pointer[_DLManagedTensor]) -> None:
    with _lock:
        entry = _live.pop(ctypes.addressof(managed.contents), None)
    if entry is not None and entry[2] is not None:
        entry[2]()


_DELETER = _Deleter(_free)  # module-lifetime: torch calls it after any tensor is gone

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def bytes_on_device(
    ptr: int,
    nbytes: int,
    device: torch.device,
    on_free: Callable[[], None] | None = None,
) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` at ``ptr``, on ``device`` (cuda:N, or cpu for
    host memory), zero-copy. ``on_free`` runs once the last tensor viewing it is gone."""
    if device.type == "cuda":
        kind, index = KDL_CUDA, device.index if device.index is not None else 0
    elif device.type == "cpu":
        kind, index = KDL_CPU, 0
    else:
        raise ValueError(f"no DLPack view on {device}")
    shape = (ctypes.c_int64 * 1)(nbytes)
    m = _DLManagedTensor()
    m.dl_tensor.data = ptr
    m.dl_tensor.device = _DLDevice(kind, index)
    m.dl_tensor.ndim = 1
    m.dl_tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
    m.dl_tensor.shape = shape
    m.dl_tensor.strides = None  # compact
    m.dl_tensor.byte_offset = 0
    m.manager_ctx = None
    m.deleter = _DELETER
    addr = ctypes.addressof(m)
    with _lock:
        _live[addr] = (m, shape, on_free)
    try:
        capsule = _capsule_new(addr, b"dltensor", None)
        t = torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        with _lock:
            _live.pop(addr, None)
        raise
    if t.device != device and not (device.index is None and t.device.type == device.type):
        raise RuntimeError(f"DLPack view landed on {t.device}, not {device}")
    return t
