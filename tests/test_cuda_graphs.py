"""The decode path through persistent, padded buffers (replayed from CUDA graphs on a GPU, run
eagerly on CPU) must give exactly what the plain eager path gives."""
import random

import numpy as np

import pytest

from engine import LLM, SamplingParams
from engine import cuda_graphs
from engine.cuda_graphs import graph_batch_sizes
from scripts.make_tiny_model import make_tiny_model


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(256)[-3:] == [240, 248, 256]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", arch="qwen2", seed=5))


@pytest.mark.parametrize("whole_rows", [True, False])
def test_padded_decode_equals_eager(model_dir, whole_rows, monkeypatch):
    """whole_rows: the block table's rows are copied whole (few rows), or only their first
    columns with the padding rows filled apart (DecodeGraphs._copy_inputs)."""
    if not whole_rows:
        monkeypatch.setattr(cuda_graphs, "_WHOLE_TABLE_ROWS_BYTES", 0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 40))] for _ in range(11)]
    # Different lengths: the batch shrinks 11 -> 1 and crosses padding sizes 16, 8, 4, 2, 1.
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True)
              for i in range(11)]
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    results = {}
    for eager in (True, False):
        llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=128,
                  max_num_seqs=12, enforce_eager=eager)
        assert (llm.core.runner.decode_graphs is None) == eager
        outs = llm.generate(prompts + [prompts[0]], params + [seeded])
        results[eager] = [o.outputs[0].token_ids for o in outs]
        stats = llm.get_stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert results[True] == results[False]


@pytest.mark.parametrize("whole_rows", [True, False])
def test_a_step_fills_its_rows_and_pads_the_rest(model_dir, whole_rows, monkeypatch):
    """Whatever the buffers held before, a step of 3 rows (padded to 4) leaves its rows' inputs
    in them and padding that writes no KV and reads one key of block 0 after them: token 0 at
    position 0, slot -1, one key, block 0."""
    import torch
    if not whole_rows:
        monkeypatch.setattr(cuda_graphs, "_WHOLE_TABLE_ROWS_BYTES", 0)
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=128, max_num_seqs=8)
    graphs = llm.core.runner.decode_graphs
    for buf in (graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.seq_lens, graphs.block_table):
        buf.fill_(77)
    ids, pos, slots = (np.array(v, dtype=np.int64) for v in ([5, 6, 7], [3, 9, 20], [3, 41, 100]))
    table = np.array([[0], [2], [6]], dtype=np.int32)
    graphs.run(ids, pos, slots, table, (pos + 1).astype(np.int32))
    assert graphs.padded_size(3) == 4
    assert graphs.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert graphs.positions[:4].tolist() == [3, 9, 20, 0]
    assert graphs.slot_mapping[:4].tolist() == [3, 41, 100, -1]
    assert graphs.seq_lens[:4].tolist() == [4, 10, 21, 1]
    assert graphs.block_table[:4, 0].tolist() == [0, 2, 6, 0]
    assert torch.equal(graphs.slot_mapping, graphs._rows[2])


def test_every_size_writes_its_logits_into_one_shared_buffer(model_dir):
    """On a GPU each captured size keeps what it returns for as long as the graph lives: the
    graphs write into one [max_batch, vocab] buffer instead of one tensor per size (which took
    8.5 GiB at max_num_seqs 512 for a 128k vocabulary, and the capture ran out of memory). On
    CPU the buffer is set by hand: the padded path's outputs are views of it, and the tokens
    are those of the plain path."""
    import torch
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    results = []
    for shared in (False, True):
        llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=128, max_num_seqs=8)
        graphs = llm.core.runner.decode_graphs
        if shared:
            graphs.logits = torch.full((8, llm.core.vocab_size), float("nan"))
            zeros = np.zeros(3, dtype=np.int64)
            out = graphs.run(zeros, zeros, np.full(3, -1, dtype=np.int64),     # writes no KV
                             np.zeros((3, 1), dtype=np.int32), np.ones(3, dtype=np.int32))
            assert out.data_ptr() == graphs.logits.data_ptr() and out.shape[0] == 3
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert results[0] == results[1]


def test_short_contexts_replay_a_graph_with_fewer_kv_splits(model_dir):
    """A graph fixes attention's split-KV count. Each size has a plain graph per count that a
    context length up to max_model_len calls for; a step replays the one for its longest
    sequence: a short context gets what an eager step would pick (one split: no merge), the
    longest what the single graph per size had. (With the separate merge kernel:
    fuse_kv_split_merge=False.)"""
    from kernels.paged_attention import choose_num_kv_splits
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=512, max_num_seqs=8,
              fuse_kv_split_merge=False)
    g = llm.core.runner.decode_graphs
    assert not g.kv_merge_in_kernel
    assert g.contexts == [511, 1023, 1024]        # the tiny model's max_model_len: 1024
    for size in g.sizes:
        variants = g.kv_split_variants(size)
        assert variants[0] == choose_num_kv_splits(size, g.num_kv_heads, 1024)
        assert g.kv_splits(size, 300) == choose_num_kv_splits(size, g.num_kv_heads, 300)
        for length in (1, 300, 511, 512, 1000, 1023, 1024):
            k = g.kv_splits(size, length)
            assert k in variants and k >= choose_num_kv_splits(size, g.num_kv_heads, length)
    assert g.kv_split_variants(1) == sorted(g.kv_split_variants(1), reverse=True)
    assert len(g.kv_split_variants(1)) > 1 and g.kv_splits(1, 300) == 1


def test_splits_merged_in_kernel_give_small_batches_many_splits(model_dir):
    """The default (fuse_kv_split_merge): attention merges its splits in its own kernel, so a
    lone sequence takes many even at short contexts (choose_fused_kv_splits at the captured
    context bound): the tiny model's 2 KV heads want 132 splits, 511 keys allow 8, 1023 keys 16.
    Batch 8 (16 programs a split) takes 16 too: the rule counts programs, not rows."""
    from engine.cuda_graphs import decode_kv_splits
    from kernels.paged_attention import choose_fused_kv_splits
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=512, max_num_seqs=8)
    g = llm.core.runner.decode_graphs
    assert g.kv_merge_in_kernel and g.contexts == [511, 1023, 1024]
    assert g.kv_splits(1, 300) == 8 and g.kv_splits(1, 511) == 8
    assert g.kv_splits(1, 600) == 16 and g.kv_splits(1, 1024) == 16
    assert g.kv_split_variants(1) == [16, 8]
    for size in g.sizes:
        for length in (1, 300, 600, 1024):
            context = next(c for c in g.contexts if c >= length)
            assert g.kv_splits(size, length) == choose_fused_kv_splits(size, g.num_kv_heads, context)
            assert g.kv_splits(size, length) == decode_kv_splits(size, g.num_kv_heads, context, True)
    # An 8B-shaped model (8 KV heads): 8 splits at batch 1 up to 511 keys, 3 at batch 16, 1 at 40.
    assert [decode_kv_splits(b, 8, 511, True) for b in (1, 4, 16, 40)] == [8, 8, 3, 1]
    assert [decode_kv_splits(b, 8, 4095, True) for b in (1, 4, 16, 40)] == [16, 9, 3, 1]
    assert decode_kv_splits(1, 8, 511, False) == 1


class _CountedKernel:
    """Stands in for a @triton.jit kernel: counts launches and their NUM_SPLITS."""

    def __init__(self, kernel):
        self.kernel, self.splits, self.merged_in_kernel = kernel, [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.splits.append(kwargs.get("NUM_SPLITS"))
            self.merged_in_kernel.append(kwargs.get("MERGE_IN_KERNEL"))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
@pytest.mark.parametrize("merge_in_kernel", [False, True])
def test_batch1_short_context_step_runs_one_attention_kernel_per_layer(model_dir, monkeypatch,
                                                                       merge_in_kernel):
    """Issue 13: with the separate merge kernel, a lone sequence of ~300 tokens replays the
    one-split plain graph, whose layers each launch one attention kernel (one program per KV
    head over the whole context, no split workspace) and no _reduce_splits_kernel; at 600
    tokens the 3-split graph merges per layer. With the splits merged in the kernel it replays
    8 splits at 300 tokens and 16 at 600, still one attention launch per layer and no merge
    kernel, and the logits agree with the separate merge's. The Triton kernels run interpreted
    through the padded decode path (what a graph captures)."""
    import torch

    from engine.cuda_graphs import DecodeGraphs
    from engine.models.attention import triton_backend
    from engine.models.loader import load_model
    from tests.kernel_support import DEVICE, load_kernels, require_runnable
    pa = load_kernels("kernels.paged_attention")
    require_runnable(pa)
    device = torch.device(DEVICE)           # interpreted on CPU, compiled where there is a GPU
    model, config = load_model(model_dir, torch.float32, device, attention_backend=triton_backend())
    shape = (64, 16, config.num_key_value_heads, config.head_dim)
    caches = [(torch.randn(shape, device=device), torch.randn(shape, device=device))
              for _ in range(config.num_hidden_layers)]
    graphs = DecodeGraphs(model, caches, max_batch=1, max_blocks_per_seq=64, max_seqlen_k=1024,
                          device=device, use_graphs=False, kv_merge_in_kernel=merge_in_kernel)
    for context, want_splits in (((300, 8), (600, 16)) if merge_in_kernel else ((300, 1), (600, 3))):
        assert graphs.kv_splits(1, context) == want_splits
        attention = _CountedKernel(pa._paged_attention_kernel)
        merge = _CountedKernel(pa._reduce_splits_kernel)
        monkeypatch.setattr(pa, "_paged_attention_kernel", attention)
        monkeypatch.setattr(pa, "_reduce_splits_kernel", merge)
        num_blocks = -(-context // 16)
        logits = graphs.run(np.array([5]), np.array([context - 1]), np.array([context - 1]),
                            np.arange(num_blocks, dtype=np.int32)[None], np.array([context], dtype=np.int32))
        monkeypatch.undo()
        assert logits.shape == (1, config.vocab_size) and logits.isfinite().all()
        assert attention.splits == [want_splits] * config.num_hidden_layers
        assert attention.merged_in_kernel == [merge_in_kernel] * config.num_hidden_layers
        separate_merges = 0 if want_splits == 1 or merge_in_kernel else config.num_hidden_layers
        assert len(merge.splits) == separate_merges
        if merge_in_kernel:     # the same step with the separate merge kernel's graph
            graphs.kv_merge_in_kernel = False
            apart = graphs.run(np.array([5]), np.array([context - 1]), np.array([context - 1]),
                               np.arange(num_blocks, dtype=np.int32)[None],
                               np.array([context], dtype=np.int32))
            graphs.kv_merge_in_kernel = True
            torch.testing.assert_close(logits, apart, atol=1e-4, rtol=1.3e-6)
