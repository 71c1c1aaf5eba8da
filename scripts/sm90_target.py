"""Triton compiling for an H100/H200 (sm_90) on a machine without a GPU: a driver that names
sm_90, and pointer stand-ins aligned to 16. Importing this module makes it the active driver.
Used by tests/test_compile_sm90.py and benchmarks/h200/decode_forms' compile_sm90.py and
warp_specialize_sm90.py."""
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class Sm90Driver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_device_interface(self):
        return torch.cuda

    def get_active_torch_device(self):
        return torch.device("cpu")


driver.set_active(Sm90Driver())


class Ptr:
    """A tensor argument as the launcher sees it: a dtype and an address aligned to 16."""

    def __init__(self, dtype=torch.bfloat16):
        self.dtype = dtype

    def data_ptr(self):
        return 1 << 20
