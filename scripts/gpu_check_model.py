"""On a GPU: the engine's model (Triton attention and fused layers, bf16) against a PyTorch
reference forward (the same weights, PyTorch ops, float32) on a Llama-3.1-8B-shaped model.
Reports ||logits - ref|| / ||ref|| and top-1 agreement for a batch of prompts."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from bench_common import git_commit, hardware, preset_dir

from engine.models.attention import TORCH_REF_BACKEND, AttentionMetadata, triton_backend
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM


def paged_inputs(lens, block_size, num_kv_heads, head_dim, layers, dtype, device):
    """One prefill of several sequences, blocks scattered through the pool."""
    num_blocks = sum(-(-n // block_size) for n in lens) + 8
    perm = torch.randperm(num_blocks).tolist()
    tables, slots = [], []
    for n in lens:
        blocks = [perm.pop() for _ in range(-(-n // block_size))]
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    meta = AttentionMetadata(torch.tensor(slots, device=device), bt, cu,
                             torch.tensor(lens, dtype=torch.int32, device=device),
                             max(lens), max(lens))
    caches = [(torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device),
               torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device))
              for _ in range(layers)]
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    return meta, caches, positions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--lens", type=int, nargs="+", default=[1, 17, 300, 1024])
    ap.add_argument("--out", default="benchmarks/gpu_model_check.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig.from_pretrained(preset_dir(args.preset))
    dev = torch.device("cuda")
    with dev:
        fast = LlamaForCausalLM(cfg, triton_backend(), fused_kernels=True).to(torch.bfloat16)
    for p in fast.parameters():              # HF-like init: std 0.02, norms 1
        if p.dim() == 1:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02)
    ids = torch.randint(0, cfg.vocab_size, (sum(args.lens),), device=dev)
    meta, caches, pos = paged_inputs(args.lens, 16, cfg.num_key_value_heads, cfg.head_dim,
                                     cfg.num_hidden_layers, torch.bfloat16, dev)
    last = torch.tensor(list(torch.tensor(args.lens).cumsum(0) - 1), device=dev)
    with torch.inference_mode():
        logits = fast.compute_logits(fast(ids, pos, caches, meta)[last])
        state = fast.state_dict()
        del fast, caches
        torch.cuda.empty_cache()
        ref_logits = {}
        for dtype in (torch.bfloat16, torch.float32):   # PyTorch ops: bf16 and the fp32 truth
            with dev:
                ref = LlamaForCausalLM(cfg, TORCH_REF_BACKEND, fused_kernels=False).to(dtype)
            ref.load_state_dict({k: v.to(dtype) for k, v in state.items()})
            meta, caches, pos = paged_inputs(args.lens, 16, cfg.num_key_value_heads,
                                             cfg.head_dim, cfg.num_hidden_layers, dtype, dev)
            ref_logits[dtype] = ref.compute_logits(ref(ids, pos, caches, meta)[last])
            del ref, caches
            torch.cuda.empty_cache()
    truth = ref_logits[torch.float32]

    def rel(x):
        return ((x - truth).norm() / truth.norm()).item()

    rel_engine, rel_torch_bf16 = rel(logits), rel(ref_logits[torch.bfloat16])
    top1 = (logits.argmax(-1) == truth.argmax(-1)).float().mean().item()
    result = {"preset": args.preset, "lens": args.lens,
              "engine_bf16_vs_fp32_relative_error": rel_engine,
              "torch_bf16_vs_fp32_relative_error": rel_torch_bf16,
              "engine_top1_agreement_with_fp32": top1,
              "criterion": "bf16 judged against PyTorch's own bf16 error on the same weights: "
                           "engine error <= 1.25 x PyTorch bf16 error",
              "hardware": hardware(), "commit": git_commit(),
              "command": " ".join(["python"] + sys.argv)}
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    assert rel_engine <= 1.25 * rel_torch_bf16, (rel_engine, rel_torch_bf16)


if __name__ == "__main__":
    main()
