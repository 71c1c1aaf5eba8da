"""Where the Triton kernel tests run, and a guard that the kernels can run there.

With CUDA the kernels run on the GPU. Without it they run in Triton's interpreter on CPU:
tests/conftest.py sets TRITON_INTERPRET=1 before any test module loads, and @triton.jit reads it
when a function is decorated, so a kernel module imported before that (e.g. through engine/) is
reloaded here. Where the kernels can run neither way, the tests fail; they never skip.
"""
import importlib

import pytest
import torch
import triton

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _own_jitted(module) -> list:
    """The @triton.jit functions `module` holds that are not Triton's own: its kernels and the
    helpers it imports from other kernel modules (kernels.rotary_write_kv: rotary's _rotate_heads)."""
    return [f for f in vars(module).values() if isinstance(f, triton.runtime.KernelInterface)
            and not getattr(getattr(f, "fn", None), "__module__", "triton").startswith("triton")]


def is_interpreted(module) -> bool:
    """Whether every @triton.jit function of ours that `module` holds runs in the interpreter (the
    test behind the kernel modules' `_INTERPRETED`, applied to all of them: kernels.paged_attention
    has no flag). Triton's own functions it holds (tl.reduce combine functions) are left to
    require_runnable."""
    jitted = _own_jitted(module)
    return bool(jitted) and not any(isinstance(f, triton.runtime.JITFunction) for f in jitted)


def load_kernels(module_name: str):
    """Import a kernel module; without CUDA, reload it if its kernels were decorated uninterpreted
    (after reloading the kernel modules it imports helpers from, so that it picks up their new ones)."""
    module = importlib.import_module(module_name)
    if not ON_GPU and not is_interpreted(module):
        # Imported before TRITON_INTERPRET was set: decorate the kernels again.
        for helper_module in sorted({f.fn.__module__ for f in _own_jitted(module)} - {module_name}):
            load_kernels(helper_module)
        module = importlib.reload(module)
    return module


def require_runnable(module, triton_functions=()) -> None:
    """pytest.fail (never skip) where `module`'s kernels can run neither on a GPU nor interpreted.

    triton_functions: Triton's own @triton.jit library functions the kernels call (e.g. tl.sum).
    Triton decorated those when it was first imported, so a reload cannot fix them.
    """
    if ON_GPU:
        return
    if not is_interpreted(module):
        pytest.fail(f"no CUDA device and the Triton kernels of {module.__name__} are not interpreted: "
                    "is TRITON_INTERPRET=0 set?")
    for fn in triton_functions:
        if isinstance(fn, triton.runtime.JITFunction):
            pytest.fail(f"triton was imported before TRITON_INTERPRET=1 was set (before tests/conftest.py "
                        f"ran?), so tl.{fn.__name__} cannot run in the interpreter: run with TRITON_INTERPRET=1 "
                        "in the environment")
