"""ctypes bindings to the CUDA runtime torch loaded, and a device copy engine on its own stream.

Used by the cuda_ipc and local transports. ctypes rather than ``cuda.bindings``/cupy: the C ABI
of these few calls is stable across CUDA 12 and 13, while the Python wrappers' signatures are
not, and torch already loaded ``libcudart`` into the process (we bind to that very library, so
streams and the primary context are shared with torch).

Nothing here runs without a GPU; :func:`cuda_runtime_available` says whether it can.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from weightsync.transport import cuda_batch

log = logging.getLogger(__name__)

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from unified virtual addresses
STREAM_NON_BLOCKING = 1
EVENT_DISABLE_TIMING = 2
IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
MEMORY_TYPE_DEVICE = 2  # cudaMemoryTypeDevice
IPC_HANDLE_BYTES = 64
MAX_PITCH = (1 << 31) - 1
POLL_MAX_S = 50e-6
"""Longest pause between two polls of a copy's completion event. With 1 ms, a 4 ms update was
seen up to 1 ms late (Qwen3-4B on one H200: p2p wire 5.4 ms against 4.55 ms for the same copies
timed by device events)."""  # cudaMemcpy2D rejects larger pitches (cudaDevAttrMaxPitch)

_vp = ctypes.c_void_p
_sz = ctypes.c_size_t


class IpcMemHandle(ctypes.Structure):
    """``cudaIpcMemHandle_t``: 64 opaque bytes, passed by value.

    ``c_byte``, not ``c_char``: reading a ``c_char`` array stops at the first NUL, and handles
    contain NULs. Convert with :meth:`to_bytes` / :meth:`from_bytes`.
    """

    _fields_ = [("reserved", ctypes.c_byte * IPC_HANDLE_BYTES)]

    def to_bytes(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), IPC_HANDLE_BYTES)

    @classmethod
    def from_bytes(cls, data: bytes) -> IpcMemHandle:
        if len(data) != IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(data)}")
        return cls.from_buffer_copy(data)


class PointerAttributes(ctypes.Structure):
    """``cudaPointerAttributes`` as of CUDA 11 and later, with spare room should it grow."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", _vp),
        ("hostPointer", _vp),
        ("spare", ctypes.c_byte * 64),
    ]


def cuda_runtime_available() -> bool:
    """True when torch sees a CUDA device (the runtime library is then loaded)."""
    return torch.cuda.is_available()


def _find_cudart() -> str:
    """Path of the libcudart torch loaded (from /proc/self/maps), else a name dlopen can find."""
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "libcudart.so" in path:
                    return path
    except OSError:
        pass
    found = ctypes.util.find_library("cudart")
    if found is None:
        raise RuntimeError("cannot find libcudart: torch did not load it and it is not on the library path")
    return found


class CudaRuntime:
    """The handful of CUDA runtime/driver calls the transports need; raises RuntimeError on errors."""

    def __init__(self) -> None:
        if not cuda_runtime_available():
            raise RuntimeError("CUDA runtime needs a visible CUDA device (torch.cuda.is_available() is false)")
        rt = ctypes.CDLL(_find_cudart())
        drv = ctypes.CDLL("libcuda.so.1")
        sigs = {
            "cudaGetErrorString": ([ctypes.c_int], ctypes.c_char_p),
            "cudaRuntimeGetVersion": ([ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
            "cudaGetDevice": ([ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
            "cudaSetDevice": ([ctypes.c_int], ctypes.c_int),
            "cudaPointerGetAttributes": ([ctypes.POINTER(PointerAttributes), _vp], ctypes.c_int),
            "cudaIpcGetMemHandle": ([ctypes.POINTER(IpcMemHandle), _vp], ctypes.c_int),
            "cudaIpcOpenMemHandle": ([ctypes.POINTER(_vp), IpcMemHandle, ctypes.c_uint], ctypes.c_int),
            "cudaIpcCloseMemHandle": ([_vp], ctypes.c_int),
            "cudaStreamCreateWithFlags": ([ctypes.POINTER(_vp), ctypes.c_uint], ctypes.c_int),
            "cudaStreamDestroy": ([_vp], ctypes.c_int),
            "cudaStreamSynchronize": ([_vp], ctypes.c_int),
            "cudaStreamWaitEvent": ([_vp, _vp, ctypes.c_uint], ctypes.c_int),
            "cudaEventCreateWithFlags": ([ctypes.POINTER(_vp), ctypes.c_uint], ctypes.c_int),
            "cudaEventRecord": ([_vp, _vp], ctypes.c_int),
            "cudaEventQuery": ([_vp], ctypes.c_int),
            "cudaEventDestroy": ([_vp], ctypes.c_int),
            "cudaMemcpyAsync": ([_vp, _vp, _sz, ctypes.c_int, _vp], ctypes.c_int),
            "cudaMemcpy2DAsync": ([_vp, _sz, _vp, _sz, _sz, _sz, ctypes.c_int, _vp], ctypes.c_int),
        }
        for name, (args, res) in sigs.items():
            fn = getattr(rt, name)
            fn.argtypes, fn.restype = args, res
        drv.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(_sz), ctypes.c_uint64]
        drv.cuMemGetAddressRange_v2.restype = ctypes.c_int
        self.rt, self.drv = rt, drv

    def check(self, ret: int, what: str) -> None:
        if ret != CUDA_SUCCESS:
            msg = self.rt.cudaGetErrorString(ret)
            raise RuntimeError(f"{what} failed: CUDA error {ret} ({msg.decode() if msg else '?'})")

    def get_device(self) -> int:
        dev = ctypes.c_int()
        self.check(self.rt.cudaGetDevice(ctypes.byref(dev)), "cudaGetDevice")
        return dev.value

    @contextmanager
    def on_device(self, device: int) -> Iterator[None]:
        """Make ``device`` current for the block (IPC mappings land in the current context)."""
        prev = self.get_device()
        self.check(self.rt.cudaSetDevice(device), f"cudaSetDevice({device})")
        try:
            yield
        finally:
            self.check(self.rt.cudaSetDevice(prev), f"cudaSetDevice({prev})")

    def pointer_device(self, ptr: int) -> int:
        """Device ordinal holding ``ptr``; raises ValueError for anything but device memory."""
        attrs = PointerAttributes()
        self.check(self.rt.cudaPointerGetAttributes(ctypes.byref(attrs), ptr), "cudaPointerGetAttributes")
        if attrs.type != MEMORY_TYPE_DEVICE:
            raise ValueError(f"address {ptr:#x} is not CUDA device memory (cudaMemoryType {attrs.type})")
        return attrs.device

    def allocation_range(self, ptr: int, device: int) -> tuple[int, int]:
        """``(base, size)`` of the cudaMalloc allocation holding ``ptr``."""
        base, size = ctypes.c_uint64(), _sz()
        with self.on_device(device):
            ret = self.drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
        if ret != CUDA_SUCCESS:
            raise RuntimeError(f"cuMemGetAddressRange({ptr:#x}) failed: CUDA driver error {ret}")
        return base.value, size.value

    def ipc_get_handle(self, base: int, device: int) -> bytes:
        handle = IpcMemHandle()
        with self.on_device(device):
            ret = self.rt.cudaIpcGetMemHandle(ctypes.byref(handle), base)
        if ret != CUDA_SUCCESS:
            self.check(
                ret,
                f"cudaIpcGetMemHandle({base:#x}) (memory from torch's expandable segments cannot be exported: "
                f"run the owner with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)",
            )
        return handle.to_bytes()

    def ipc_open(self, handle: bytes, device: int) -> int:
        """Map a peer allocation into ``device``'s context (the writer's: copies then run at link rate)."""
        h = IpcMemHandle.from_bytes(handle)
        ptr = _vp()
        with self.on_device(device):
            ret = self.rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, IPC_LAZY_ENABLE_PEER_ACCESS)
        self.check(ret, "cudaIpcOpenMemHandle")
        return int(ptr.value or 0)

    def ipc_close(self, ptr: int, device: int) -> None:
        with self.on_device(device):
            self.check(self.rt.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")


class DeviceCopier:
    """Issues copies on a private non-blocking stream of one device; completion is an event.

    Each submission first waits for the work already queued on torch's current stream of the
    device, so a staging buffer packed there is complete before it is read. How the runs of a
    submission are copied is ``method`` (:data:`~weightsync.transport.cuda_batch.COPY_METHODS`):
    a batch of at least :data:`~weightsync.transport.cuda_batch.MIN_BATCHED_RUNS` runs goes as one
    Triton kernel launch over a device chunk table (``kernel``) or one ``cudaMemcpyBatchAsync``
    (``memcpy_batch``), prepared on its first submission and kept while its ``blocks`` array
    lives; smaller batches, and every batch with ``runs``, issue one ``cudaMemcpyAsync`` /
    ``cudaMemcpy2DAsync`` per run or 2-D block.
    """

    def __init__(self, rt: CudaRuntime, device: int, *, method: str | None = None) -> None:
        self.rt, self.device = rt, device
        self.method = cuda_batch.copy_method(method)
        if self.method == "kernel" and not cuda_batch.triton_available():
            log.warning("Triton is not importable: device copies fall back to one cudaMemcpyAsync per run")
            self.method = "runs"
        self._memcpy_batch = cuda_batch.bind_memcpy_batch(rt.rt) if self.method == "memcpy_batch" else None
        if self.method == "memcpy_batch" and self._memcpy_batch is None:
            log.warning("this CUDA runtime has no cudaMemcpyBatchAsync: device copies issue one copy per run")
            self.method = "runs"
        stream = _vp()
        with rt.on_device(device):
            rt.check(rt.rt.cudaStreamCreateWithFlags(ctypes.byref(stream), STREAM_NON_BLOCKING), "cudaStreamCreate")
        self.stream = stream
        self._torch_stream = torch.cuda.ExternalStream(int(stream.value or 0), device=torch.device("cuda", device))
        self._prepared: dict[int, tuple[Any, Any]] = {}

    def _event(self) -> _vp:
        ev = _vp()
        self.rt.check(self.rt.rt.cudaEventCreateWithFlags(ctypes.byref(ev), EVENT_DISABLE_TIMING), "cudaEventCreate")
        return ev

    def _batched(self, blocks: np.ndarray) -> Any:
        """The prepared batched copy of ``blocks`` (built on first use), or None for the per-run path."""
        if self.method == "runs" or int(blocks[:, 3].sum()) < cuda_batch.MIN_BATCHED_RUNS:
            return None
        key = id(blocks)
        hit = self._prepared.get(key)
        if hit is not None and hit[0]() is blocks:
            return hit[1]
        runs = cuda_batch.block_runs(blocks)
        if self.method == "kernel":
            prepared: Any = cuda_batch.KernelBatch(runs, torch.device("cuda", self.device))
        else:
            assert self._memcpy_batch is not None
            prepared = cuda_batch.MemcpyBatch(runs, self.device, self._memcpy_batch)
        self._prepared[key] = (weakref.ref(blocks, lambda _r, k=key: self._prepared.pop(k, None)), prepared)
        return prepared

    def submit(self, blocks: np.ndarray) -> _vp:
        """Enqueue the 2-D blocks (``strided_blocks`` rows); returns the completion event."""
        rt = self.rt
        with rt.on_device(self.device):
            self._after_current_stream()
            batched = self._batched(blocks) if len(blocks) else None
            if isinstance(batched, cuda_batch.KernelBatch):
                batched.launch(self._torch_stream)
            elif batched is not None:
                rt.check(batched.launch(self.stream.value), f"cudaMemcpyBatchAsync ({batched.count} copies)")
            else:
                self._submit_runs(blocks)
            return self._done()

    def submit_work(self, work: Callable[[], None]) -> _vp:
        """Enqueue ``work`` (device work launched on torch's current stream, which is this
        copier's stream while it runs) in place of a copy; returns the completion event."""
        with self.rt.on_device(self.device):
            self._after_current_stream()
            with torch.cuda.stream(self._torch_stream):
                work()
            return self._done()

    def _after_current_stream(self) -> None:
        """Order this copier's stream after the work queued on torch's current stream."""
        rt, lib = self.rt, self.rt.rt
        ready = self._event()
        rt.check(lib.cudaEventRecord(ready, torch.cuda.current_stream(self.device).cuda_stream), "cudaEventRecord")
        rt.check(lib.cudaStreamWaitEvent(self.stream, ready, 0), "cudaStreamWaitEvent")
        rt.check(lib.cudaEventDestroy(ready), "cudaEventDestroy")

    def _done(self) -> _vp:
        done = self._event()
        self.rt.check(self.rt.rt.cudaEventRecord(done, self.stream), "cudaEventRecord")
        return done

    def _submit_runs(self, blocks: np.ndarray) -> None:
        rt, lib = self.rt, self.rt.rt
        for s, d, w, h, sp, dp in blocks.tolist():
            if h > 1 and max(sp, dp) <= MAX_PITCH:
                ret = lib.cudaMemcpy2DAsync(d, dp, s, sp, w, h, MEMCPY_DEFAULT, self.stream)
                if ret != CUDA_SUCCESS:
                    rt.check(ret, f"cudaMemcpy2DAsync({d:#x} <- {s:#x}, {w} x {h})")
                continue
            for r in range(h):
                ret = lib.cudaMemcpyAsync(d + r * dp, s + r * sp, w, MEMCPY_DEFAULT, self.stream)
                if ret != CUDA_SUCCESS:
                    rt.check(ret, f"cudaMemcpyAsync({d + r * dp:#x} <- {s + r * sp:#x}, {w})")

    def wait(self, event: _vp, deadline: float) -> bool:
        """Poll ``event`` until done (True, event destroyed) or ``deadline`` passes (False)."""
        pause = 20e-6
        while True:
            ret = self.rt.rt.cudaEventQuery(event)
            if ret == CUDA_SUCCESS:
                self.rt.check(self.rt.rt.cudaEventDestroy(event), "cudaEventDestroy")
                return True
            if ret != CUDA_ERROR_NOT_READY:
                self.rt.check(ret, "cudaEventQuery (an issued copy failed)")
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)

    def close(self) -> None:
        """Finish queued copies and destroy the stream."""
        self._prepared.clear()
        with self.rt.on_device(self.device):
            self.rt.check(self.rt.rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
            self.rt.check(self.rt.rt.cudaStreamDestroy(self.stream), "cudaStreamDestroy")


device_tensor = cuda_batch.raw_device_tensor
"""A uint8 torch view of raw device memory (no ownership)."""
