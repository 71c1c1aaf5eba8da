import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Without a GPU the Triton kernels run in Triton's interpreter. It must be chosen before triton
# is first imported (torch._dynamo imports it with transformers' models), so it is set here,
# before any test module loads.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
