"""The full engine on a GPU (Triton kernels, CUDA graphs, chunked prefill, preemption) against
HF transformers on the same GPU, in float32. Needs CUDA: CI has none, so this runs on the GPU
machine (`python -m pytest tests/test_gpu_engine.py`) and its output is kept in benchmarks/."""
import pytest
import torch

from engine import LLM, SamplingParams
from scripts.make_tiny_model import make_tiny_model
from tests.test_llm import hf_greedy, mixed_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run on the GPU machine)")

ARCHS = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_tiny_model(root / arch, arch=arch, seed=1)) for arch in ARCHS}


def hf_greedy_cuda(model_dir, prompts, max_tokens=32):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_on_gpu_equals_hf(tiny_models, arch):
    import json
    vocab = json.load(open(f"{tiny_models[arch]}/config.json"))["vocab_size"]
    prompts = mixed_prompts(vocab)
    expected = hf_greedy_cuda(tiny_models[arch], prompts)
    llm = LLM(tiny_models[arch], dtype="float32", device="cuda", block_size=16,
              max_num_batched_tokens=64, num_kv_blocks=30, max_model_len=400, max_num_seqs=16)
    assert llm.core.runner.decode_graphs.graphs, "CUDA graphs were not captured"
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"prompt {i} (len {len(prompts[i])}) differs"
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_gpu_engine_equals_cpu_engine_fp32(tiny_models):
    """Same engine, CPU (PyTorch path) and GPU (Triton path), fp32: identical greedy tokens."""
    prompts = mixed_prompts(1024, n=8, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cpu = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=256)
    gpu = LLM(tiny_models["llama"], dtype="float32", device="cuda", num_kv_blocks=256)
    a = [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    assert a == b


def test_async_engine_core_process_on_the_gpu_it_is_given(tiny_models):
    """AsyncEngine starts its core process pinned to cuda:N (CUDA_VISIBLE_DEVICES=N); its
    streamed output equals the in-process engine's."""
    import asyncio
    from engine import AsyncEngine
    device = f"cuda:{torch.cuda.device_count() - 1}"
    prompts = [f"gpu stream {i}" for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = LLM(tiny_models["llama"], dtype="float32", device=device,
                   num_kv_blocks=256).generate(prompts, params)
    engine = AsyncEngine(model=tiny_models["llama"], dtype="float32", device=device,
                         num_kv_blocks=256)

    async def one(i, p):
        return [t async for o in engine.generate(p, params, f"g{i}") for t in o.outputs[0].token_ids]

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        with open(f"/proc/{engine.core.pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        got = asyncio.run(main())
    finally:
        engine.shutdown()
    import os
    index = int(device.split(":")[1])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    want = visible.split(",")[index].strip() if visible else str(index)
    assert env[b"CUDA_VISIBLE_DEVICES"] == want.encode()
    assert got == [o.outputs[0].token_ids for o in expected]


def _poison_free_memory() -> None:
    """Fills the GPU memory the next engine will be given with 0xFF bytes (int64 -1, a NaN in
    bf16), as a previous engine's data would be: a read of a buffer before its fill then
    fails loudly (an index out of bounds) instead of finding zeros by luck."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    junk = torch.empty(int(free * 0.9), dtype=torch.uint8, device="cuda")
    junk.fill_(0xFF)
    torch.cuda.synchronize()
    del junk
    torch.cuda.empty_cache()


def test_engines_created_one_after_another_capture_cleanly():
    """Issue 10: the second of two 8B engines made one after the other in a process crashed
    with a device-side assert in DecodeGraphs.capture: the warm-up ran on a side stream before
    the current stream had filled the new input buffers (queued behind the KV cache's zero fill,
    ~100 GB with the cache sized from memory), so it read what those bytes held from the first
    engine. 10 times two engines in a row, each with the default settings (KV cache sized from
    memory, 256 sequences) and handed back before the next: every one captures its graphs and
    gives the same greedy tokens."""
    import gc

    from scripts.bench_common import preset_dir
    prompts = [[128000] + list(range(1000, 1000 + n)) for n in (5, 37, 300)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    first = None
    for i in range(20):
        _poison_free_memory()
        llm = LLM(preset_dir("llama-3.1-8b"), load_format="dummy", dtype="bfloat16",
                  device="cuda", skip_tokenizer_init=True)
        assert llm.core.runner.decode_graphs.graphs, "CUDA graphs were not captured"
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        torch.cuda.synchronize()
        first = first or got
        assert got == first, f"engine {i} differs from engine 0"
        llm.core.shutdown()
        del llm
        gc.collect()


def _num_compiled(module) -> dict[str, int]:
    """Compiled variants of each @triton.jit kernel of a module (all devices)."""
    import triton
    out = {}
    for name, fn in vars(module).items():
        if isinstance(fn, triton.runtime.JITFunction):
            out[name] = sum(len(entry[0]) for entry in fn.device_caches.values())
    return out


def test_no_kernel_compiles_after_start_up():
    """Issue 11: the first round after start ran 30-60% slower, and any new mix of batch sizes
    compiled a kernel variant mid-serving (a 1.5 s TTFT). After start-up (graph capture and
    the runner's warm-up) a workload of every shape class (lone and batched requests, prompts
    of 1..1000 tokens, chunked prefill mixed with decode, sampling) compiles nothing."""
    from kernels import activation, kv_cache, paged_attention, rmsnorm, rotary
    from scripts.bench_common import preset_dir
    modules = [activation, kv_cache, paged_attention, rmsnorm, rotary]
    llm = LLM(preset_dir("llama-3.1-8b"), load_format="dummy", dtype="bfloat16", device="cuda",
              skip_tokenizer_init=True, max_num_seqs=32, max_num_batched_tokens=256,
              num_kv_blocks=2048, max_model_len=2048)
    try:
        before = {m.__name__: _num_compiled(m) for m in modules}
        assert before["kernels.paged_attention"]["_paged_attention_kernel"] > 0
        for n in (1, 3, 32):
            prompts = [[128000] + list(range(7, 7 + length)) for length in
                       ([1, 5, 16, 17, 33, 300, 1000] * 5)[:n]]
            params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.9,
                                     top_p=0.95, seed=i, ignore_eos=True) for i in range(n)]
            llm.generate(prompts, params)
        after = {m.__name__: _num_compiled(m) for m in modules}
        assert after == before
    finally:
        llm.core.shutdown()
