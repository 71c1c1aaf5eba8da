"""One-off (twentieth session): the attention kernels at the shapes where the open issues spend time,
each launched twice after a compile run, for ncu to read. Run from the repository root with
PYTHONPATH=. under ncu: see ncu_attention_and_rows.md."""
import sys

import torch

import kernels.cascade_attention as ca
import kernels.paged_attention as pa
from scripts.gpu_check_attention import D
from scripts.gpu_check_cascade import Batch, decode_groups

which = sys.argv[1]
torch.cuda.cudart().cudaProfilerStop()
if which == "cascade":      # RFC decode graph step: 256 rows, 16 groups x 16, 2000 shared, 250 own
    b = Batch(decode_groups(16, 2000, num_rows=256, own_len=250), seed=1)
    out = torch.empty_like(b.q)
    fn = lambda: b.cascade(out=out)  # noqa: E731
elif which == "plain":      # 1000 x 1000 decode: 256 rows of ~1500 keys
    b = Batch([], [(1, 1500)] * 256, seed=2)
    fn = b.plain
elif which == "prompt":     # RFC prompt step: chunks alone (prefix 0), prompt tiles
    b = Batch([(64, [(1, 10), (1, 10)]), (2000, [(200, 200)] * 22)], [(2200, 2200)], seed=3)
    q, k, v, table, cu, seq_lens, prefix_lens, _ = b.args()
    prefix_lens = torch.where(torch.arange(len(prefix_lens), device=q.device) < 2, prefix_lens, 0)
    one_group = torch.tensor([0, 2], dtype=torch.int32, device=q.device)
    decodes = torch.tensor([0, 1], dtype=torch.int32, device=q.device)
    prompts = torch.arange(2, len(prefix_lens), dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    fn = lambda: ca.cascade_attention(  # noqa: E731
        q, k, v, table, cu, seq_lens, prefix_lens, one_group, D ** -0.5, max_seqlen_q=b.max_seqlen_q,
        max_group_rows=2, max_prefix_len=64, out=out, own_decode_seqs=decodes, own_prompt_seqs=prompts,
        prompt_prefixes=False)
fn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
fn()
fn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print(which, "done")
