"""The control for tests/test_gpu_engine.py::test_cascade_engine_near_plain_engine_bf16 (GPU):
the plain engine (no cascade, no prefix caching) in bf16 against itself at another max_num_seqs,
on the test's 44 prompts: how many sequences part, at which top-2 gaps, and how far apart the
chosen tokens' logprobs are before a parting. A different batch limit picks other GEMM kernels,
so this is the rounding noise the cascade path is judged against.

    python scripts/bf16_tie_control.py
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import LLM, SamplingParams
from scripts.make_tiny_model import make_tiny_model
from scripts.greedy_checks import greedy_partings, shared_prefix_workload

root = tempfile.mkdtemp()
model = str(make_tiny_model(f"{root}/llama", arch="llama", seed=1))
prompts = shared_prefix_workload(seed=4) + shared_prefix_workload(seed=5)
params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
runs = {}
for seqs in (64, 16, 8):
    llm = LLM(model, dtype="bfloat16", device="cuda", enable_prefix_caching=False,
              enable_prefix_groups=False, enable_cascade_attention=False, num_kv_blocks=512,
              max_num_seqs=seqs)
    runs[seqs] = llm.generate(prompts, params)
    llm.core.shutdown()
for other in (16, 8):
    same, drift, gaps = greedy_partings(runs[other], runs[64])
    print(f"plain max_num_seqs={other} vs 64: {same} of {len(prompts)} match whole; "
          f"drift {drift:.4f}; partings {gaps}")
