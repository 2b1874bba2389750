"""How a host thread waits for the GPU: asleep, not spinning.

By default CUDA's runtime spins a host thread on the CPU while it waits for the GPU (a copy to
the host, a synchronize), so every tick holds a whole core for as long as its GPU work runs.
That core is what a busy host lacks: the answers' sends and the stubs' request threads run
late beside it, and on a virtual machine whose hypervisor takes time away the spinning thread
competes with them for what is left. With the primary context's blocking-sync flag the waiting
thread sleeps until the GPU signals it, at the cost of a wake-up (microseconds against a
frame's 80 ms).

The flag belongs to the device's primary context, the one PyTorch uses; it is set through the
driver API, which accepts it before or after the context is made.
"""

from __future__ import annotations

import ctypes

CU_CTX_SCHED_BLOCKING_SYNC = 0x04
CU_CTX_SCHED_MASK = 0x07


def _driver() -> ctypes.CDLL:
    cuda = ctypes.CDLL("libcuda.so.1")
    _check(cuda.cuInit(0), "cuInit")
    return cuda


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {result}")


def _device_handle(cuda: ctypes.CDLL, device: str) -> ctypes.c_int:
    index = int(device.partition(":")[2] or 0)  # as CUDA_VISIBLE_DEVICES numbers them, like PyTorch
    handle = ctypes.c_int()
    _check(cuda.cuDeviceGet(ctypes.byref(handle), index), "cuDeviceGet")
    return handle


def sleep_while_gpu_works(device: str) -> bool:
    """Makes host threads of this process that wait for `device` sleep instead of spinning;
    False (nothing done) where `device` is not a CUDA device."""
    if not device.startswith("cuda"):
        return False
    cuda = _driver()
    _check(cuda.cuDevicePrimaryCtxSetFlags_v2(_device_handle(cuda, device), CU_CTX_SCHED_BLOCKING_SYNC),
           "cuDevicePrimaryCtxSetFlags")
    return True


def waits_asleep(device: str) -> bool:
    """Whether the primary context of CUDA `device` has the blocking-sync flag."""
    cuda = _driver()
    flags, active = ctypes.c_uint(), ctypes.c_int()
    _check(cuda.cuDevicePrimaryCtxGetState(_device_handle(cuda, device), ctypes.byref(flags), ctypes.byref(active)),
           "cuDevicePrimaryCtxGetState")
    return flags.value & CU_CTX_SCHED_MASK == CU_CTX_SCHED_BLOCKING_SYNC
