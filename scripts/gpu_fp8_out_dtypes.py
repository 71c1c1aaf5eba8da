"""Does the FP8 weights path (`quantization="fp8"`) run on this GPU for models of each dtype?
torch._scaled_mm with row-wise scales is asked for output in the model's dtype; cuBLAS versions
differ in which output dtypes they take. Prints one line a dtype: the bare product, then a tiny
model's greedy generation through LLM.

    PYTHONPATH=. python3 scripts/gpu_fp8_out_dtypes.py
"""
import tempfile

import torch

from engine import LLM, SamplingParams
from scripts.make_tiny_model import make_tiny_model

print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
model = str(make_tiny_model(tempfile.mkdtemp() + "/llama", arch="llama", seed=2))
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    try:
        a = torch.randn(64, 256, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(128, 256, device="cuda").to(torch.float8_e4m3fn)
        y = torch._scaled_mm(a, b.t(), scale_a=torch.ones(64, 1, device="cuda"),
                             scale_b=torch.ones(1, 128, device="cuda"), out_dtype=dtype)
        err = float((y.float() - a.float() @ b.float().t()).abs().max())
        print(dtype, "_scaled_mm ok, max error", err)
    except Exception as e:  # noqa: BLE001
        print(dtype, "_scaled_mm FAILED", type(e).__name__, str(e)[:300])
    try:
        llm = LLM(model=model, dtype=str(dtype).removeprefix("torch."), device="cuda",
                  quantization="fp8", num_kv_blocks=64, max_model_len=256)
        out = llm.generate(["the cat"], SamplingParams(max_tokens=8, temperature=0))
        print(dtype, "LLM ok", out[0].outputs[0].token_ids)
        del llm
    except Exception as e:  # noqa: BLE001
        print(dtype, "LLM FAILED", type(e).__name__, str(e)[:300])
