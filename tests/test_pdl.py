"""kernels/pdl.py and the PDL chain of a small decode step (engine/cuda_graphs.py).

PDL itself runs only on a Hopper GPU (tests/test_gpu_engine.py); here: the rules, the kernels'
refusal where it cannot launch, and that a decode step of up to 16 rows asks every Triton kernel
for it while larger steps ask none."""
import dataclasses

import numpy as np
import pytest
import torch

from kernels import pdl
from tests.kernel_support import ON_GPU, load_kernels, require_runnable


def test_cpu_has_no_pdl_and_asking_for_it_names_the_need():
    assert not pdl.supported(torch.device("cpu"))
    pdl.check(False, torch.device("cpu"), "some_kernel")
    with pytest.raises(ValueError, match="some_kernel: pdl=True needs a CUDA device of compute capability >= 9.0"):
        pdl.check(True, torch.device("cpu"), "some_kernel")
    assert pdl.launch_options(True) == {"launch_pdl": True} and pdl.launch_options(False) == {}


def _kernel_modules():
    """The kernel modules of a decode step's PDL chain, runnable here (interpreted on CPU):
    rmsnorm, activation, rotary_write_kv, paged_attention, skinny_gemm."""
    modules = [load_kernels(f"kernels.{name}") for name in
               ("rmsnorm", "activation", "rotary_write_kv", "paged_attention", "skinny_gemm")]
    for m in modules:
        require_runnable(m)
    return modules


@pytest.mark.skipif(ON_GPU, reason="the refusal is for devices without PDL; the GPU runs it (test_gpu_engine.py)")
def test_every_kernel_refuses_pdl_where_it_cannot_launch():
    rms, act, rot, pa, sg = _kernel_modules()
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="rms_norm: pdl=True"):
        rms.rms_norm(x, torch.ones(64), 1e-6, pdl=True)
    with pytest.raises(ValueError, match="silu_and_mul: pdl=True"):
        act.silu_and_mul(x, pdl=True)
    with pytest.raises(ValueError, match="skinny_gemm: pdl=True"):
        sg.skinny_gemm(x, torch.randn(8, 64), pdl=True)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    cache = torch.zeros(4, 16, 2, 16)
    slots, pos = torch.tensor([0, 1]), torch.tensor([0, 1])
    cos, sin = torch.randn(8, 8), torch.randn(8, 8)
    with pytest.raises(ValueError, match="rotary_write_kv: pdl=True"):
        rot.rotary_write_kv(q, k, v, cache, cache.clone(), slots, pos, cos, sin, pdl=True)
    table = torch.zeros(2, 1, dtype=torch.int32)
    cu, lens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="paged_attention: pdl=True"):
        pa.paged_attention(q, cache, cache, table, cu, lens, 0.25, max_seqlen_q=1, max_seqlen_k=2, pdl=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from scripts.make_tiny_model import make_tiny_model
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=3))


@pytest.mark.skipif(ON_GPU, reason="the kernels run interpreted on CPU tensors here; on the GPU "
                    "test_gpu_engine.py runs the PDL chain")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
def test_decode_steps_of_up_to_16_rows_launch_every_triton_kernel_with_pdl(model_dir, monkeypatch):
    """DecodeGraphs(pdl=True): a step of up to 16 rows (what the graphs of those sizes capture)
    asks each RMSNorm, projection (the lm_head too), rotary + KV write, attention and SiLU-and-mul
    call for PDL, and the projections run their skinny_chain config; a 24-row step asks none and runs F.linear.
    The kernels run interpreted, without PDL (the recorders drop it); the logits equal those
    of the same steps with pdl=False."""
    import engine.models.linear as linear_module
    import engine.models.llama as llama_module
    from engine.cuda_graphs import DecodeGraphs
    from engine.models.attention import triton_backend
    from engine.models.linear import Linear
    from engine.models.loader import load_model
    rms, act, rot, pa, sg = _kernel_modules()
    calls: list[tuple[str, bool]] = []

    def recorded(name, fn):
        def run(*args, pdl=False, **kwargs):
            calls.append((name, pdl))
            return fn(*args, **kwargs)
        return run
    monkeypatch.setattr(llama_module, "rms_norm", recorded("rms_norm", rms.rms_norm))
    monkeypatch.setattr(linear_module, "skinny_gemm", recorded("skinny_gemm", sg.skinny_gemm))
    monkeypatch.setattr(linear_module, "silu_and_mul", recorded("silu_and_mul", act.silu_and_mul))
    attention = recorded("paged_attention", pa.paged_attention)
    # The backend's run() imports paged_attention when it is built: rebuild it over the recorder.
    monkeypatch.setattr(pa, "paged_attention", attention)
    backend = dataclasses.replace(triton_backend(), rotary_write_kv=recorded("rotary_write_kv", rot.rotary_write_kv))
    model, config = load_model(model_dir, torch.float32, torch.device("cpu"), attention_backend=backend,
                               fused_kernels=True)
    chain = sg.SkinnyConfig(16, 16, 1)
    for lin in model.modules():
        if isinstance(lin, Linear):
            lin.skinny_chain = {b: chain for b in (1, 2, 4, 8, 16)}
    shape = (64, 16, config.num_key_value_heads, config.head_dim)
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
              for _ in range(config.num_hidden_layers)]
    layers = config.num_hidden_layers
    logits = {}
    for use_pdl in (True, False):
        graphs = DecodeGraphs(model, caches, max_batch=24, max_blocks_per_seq=8, max_seqlen_k=128,
                              device=torch.device("cpu"), use_graphs=False, pdl=use_pdl)
        for rows in (3, 20):
            calls.clear()
            blocks = np.arange(rows * 2, dtype=np.int32).reshape(rows, 2)
            ctx = np.full(rows, 20, dtype=np.int32)
            slots = blocks[:, 1] * 16 + 3
            logits[use_pdl, rows] = graphs.run(np.arange(5, 5 + rows), np.full(rows, 19), slots, blocks, ctx)
            kinds = sorted({name for name, _ in calls})
            asked = use_pdl and rows <= 16
            assert {p for _, p in calls} == {asked}, (use_pdl, rows)
            assert kinds == (["paged_attention", "rms_norm", "rotary_write_kv", "silu_and_mul", "skinny_gemm"]
                             if asked else ["paged_attention", "rms_norm", "rotary_write_kv", "silu_and_mul"])
            counts = {k: sum(1 for n, _ in calls if n == k) for k in kinds}
            assert counts["rms_norm"] == 2 * layers + 1 and counts["paged_attention"] == layers
            if asked:                  # qkv, o_proj, gate_up, down and the lm_head: skinny, PDL
                assert model.lm_head is not None
                assert counts["skinny_gemm"] == 4 * layers + 1
    for rows in (3, 20):
        torch.testing.assert_close(logits[True, rows], logits[False, rows], atol=1e-4, rtol=1.3e-6)


@pytest.mark.skipif(not (ON_GPU and pdl.supported(torch.device("cuda"))),
                    reason="PDL needs a GPU of compute capability >= 9.0 (the GPU machine runs this)")
@pytest.mark.parametrize("hidden", [1024, 1000])          # 1000: K not a whole number of steps
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_pdl_chain_in_a_cuda_graph_gives_the_bits_of_the_plain_chain(dtype, hidden):
    """norm -> skinny GEMM -> SiLU-and-mul -> skinny GEMM (+ residual norm), as a decode layer's
    MLP runs them, captured in a CUDA graph with and without PDL (and with PDL, the last GEMM's
    K slices merged by the norm: decode_late_merge) and replayed on new inputs: the same bits
    (PDL changes when kernels start, not what they compute)."""
    from kernels.activation import silu_and_mul
    from kernels.rmsnorm import rms_norm
    from kernels.skinny_gemm import SkinnyConfig, skinny_gemm
    gen = torch.Generator(device="cuda").manual_seed(0)
    inter = 2816
    w_up = torch.randn(2 * inter, hidden, device="cuda", dtype=dtype, generator=gen) / hidden ** 0.5
    w_down = torch.randn(hidden, inter, device="cuda", dtype=dtype, generator=gen) / inter ** 0.5
    norm_w = torch.rand(hidden, device="cuda", dtype=dtype, generator=gen) + 0.5
    x = torch.randn(4, hidden, device="cuda", dtype=dtype, generator=gen)
    res = torch.randn(4, hidden, device="cuda", dtype=dtype, generator=gen)
    cfg = SkinnyConfig(64, 128, 4)

    def chain(use_pdl, unmerged=False):
        h, r = rms_norm(x, norm_w, 1e-5, res, pdl=use_pdl)
        up = skinny_gemm(h, w_up, config=cfg, pdl=use_pdl)
        a = silu_and_mul(up, pdl=use_pdl)
        if unmerged:        # decode_late_merge: the norm merges down's K slices
            parts = skinny_gemm(a, w_down, config=cfg, pdl=use_pdl, merge=False)
            return rms_norm(None, norm_w, 1e-5, r, pdl=use_pdl, x_parts=parts)[0]
        y = skinny_gemm(a, w_down, config=cfg, pdl=use_pdl)
        return rms_norm(y, norm_w, 1e-5, r, pdl=use_pdl)[0]

    outs = {}
    for use_pdl, unmerged in ((False, False), (True, False), (True, True)):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(use_pdl, unmerged)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = chain(use_pdl, unmerged)
        got = []
        for seed in (1, 2):
            g = torch.Generator(device="cuda").manual_seed(seed)
            x.copy_(torch.randn(x.shape, device="cuda", dtype=dtype, generator=g))
            res.copy_(torch.randn(res.shape, device="cuda", dtype=dtype, generator=g))
            graph.replay()
            torch.cuda.synchronize()
            got.append(out.clone())
        outs[use_pdl, unmerged] = got
    for variant in ((True, False), (True, True)):
        for a, b in zip(outs[False, False], outs[variant]):
            assert torch.equal(a, b), variant
    assert not torch.equal(outs[True, False][0], outs[True, False][1])
