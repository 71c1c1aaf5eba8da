"""ModelRunner pieces that the engine tests do not reach on CPU."""
import pytest

from engine.config import EngineConfig
from engine.model_runner import SUGGESTION_HEADROOM, ModelRunner, kv_cache_blocks
from scripts.make_tiny_model import make_tiny_model


def test_warm_up_runs_a_mixed_step_and_every_sampler_path(tmp_path):
    """The GPU runner warms up at start (tests/test_gpu_engine.py checks that nothing compiles
    later); on CPU it is skipped at start, so run it here: same code path, torch kernels."""
    import torch
    model = str(make_tiny_model(tmp_path / "m", arch="llama", seed=1))
    config = EngineConfig(model=model, dtype="float32", device="cpu", num_kv_blocks=16)
    runner = ModelRunner(config, torch.device("cpu"), torch.float32, [1])
    runner.allocate_kv_cache(16, 256)
    before = [k.clone() for k, _ in runner.kv_caches]
    # The mixed step is ordered as _prepare_inputs orders one (decode row first, its own
    # tensors for the chunks), so the GPU compiles the kernel variants serving will run.
    from engine.models.attention import AttentionBackend
    seen = []
    attn0 = runner.model.layers[0].self_attn.attn
    real = attn0.backend

    def record(q, k_cache, v_cache, attn, scale, window):
        seen.append((attn.num_decodes, attn.max_seqlen_q, attn.chunk_cu_seqlens_q is not None))
        return real.paged_attention(q, k_cache, v_cache, attn, scale, window)
    attn0.backend = AttentionBackend("record", real.write_kv, record)
    runner._warm_up()
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, runner.kv_caches))  # no KV write
    assert (1, 40, True) in seen, seen


def test_a_mixed_step_puts_decode_rows_first_and_answers_in_the_scheduler_order(tmp_path):
    """The runner orders a mixed step's rows decode first (AttentionMetadata.num_decodes) and
    hands the sampled tokens back in the scheduler's order: the tokens equal the same requests
    run one by one."""
    from engine import LLM, SamplingParams
    model = str(make_tiny_model(tmp_path / "m", arch="llama", seed=2))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i] * (3 + 7 * i) for i in range(4)]
    alone = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64)
    want = [alone.generate([p], params)[0].outputs[0].token_ids for p in prompts]

    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64,
              max_num_batched_tokens=8, enable_prefix_caching=False)
    core = llm.core
    seen = []
    prepare = core.runner._prepare_inputs

    def spy(sched):
        x = prepare(sched)
        seen.append((x.q_lens.tolist(), x.num_decodes))
        return x
    core.runner._prepare_inputs = spy
    # Staggered: a later request's prompt chunks run beside earlier ones' decode rows.
    from tests.test_llm import staggered_tokens
    assert staggered_tokens(core, prompts, [params] * len(prompts)) == want
    mixed = [(q, nd) for q, nd in seen if 1 in q and max(q) > 1]
    assert mixed, seen
    for q, nd in seen:
        assert q[:nd] == [1] * nd and (nd == len(q) or q[nd] != 1), (q, nd)
    assert any(0 < nd < len(q) for q, nd in mixed)


def test_piecewise_token_sizes():
    """The token counts captured for steps with prompt chunks: every 32 to 512, every 64 after,
    up to the largest step size (which need not be a multiple)."""
    from engine.piecewise_graphs import token_sizes
    sizes = token_sizes(2048)
    assert sizes[:3] == [32, 64, 96] and 512 in sizes and 1024 in sizes and sizes[-1] == 2048
    assert all(b - a == (32 if b <= 512 else 64) for a, b in zip(sizes, sizes[1:]))
    assert token_sizes(64) == [32, 64]
    assert token_sizes(100) == [32, 64, 96, 100]
    assert token_sizes(16) == [16]
    assert token_sizes(1000)[-2:] == [960, 1000]


def test_block_tables_keep_rows_between_steps_and_gather_a_steps_rows():
    """The runner's block ids live in one table between steps (rows by request, zeros past a
    request's blocks, rows and columns grown on demand): a step's table is one gather, equal
    to the table built row by row."""
    import numpy as np
    from engine.model_runner import _BlockTables
    tables = _BlockTables()
    held = {}
    for i in range(40):                              # more rows than it starts with
        held[i] = [1000 + i, 2000 + i]
    rows = {i: tables.add(ids) for i, ids in held.items()}
    tables.put(rows[3], 2, list(range(100)))         # more columns than it starts with
    held[3] += list(range(100))
    freed = [rows[5], rows[7]]
    for i in (5, 7):
        tables.remove(rows[i], len(held[i]))
        del held[i], rows[i]
    rows[99] = tables.add([7, 8, 9])                 # a freed row, reused: no stale ids
    held[99] = [7, 8, 9]
    order = [99, 3, 0, 12]
    width = max(len(held[i]) for i in order)
    expected = np.zeros((len(order), width), dtype=np.int32)
    for k, i in enumerate(order):
        expected[k, :len(held[i])] = held[i]
    got = tables.gather([rows[i] for i in order], width)
    assert got.dtype == np.int32 and got.flags.c_contiguous
    assert (got == expected).all()
    assert rows[99] == freed[-1]


def test_a_decode_step_that_fits_the_cut_graphs_is_timed_as_a_decode_graph_step(tmp_path):
    """A decode-only step replays the decode graph even where its rows would fit the graphs cut
    at attention (piecewise_graphs, CUDA only): it must not go through them nor be counted as
    one of their steps (piecewise_step_share). On CPU the decode path runs without capturing;
    a stand-in for the cut graphs that takes every size and fails when run shows the choice."""
    from engine import LLM, SamplingParams

    class CutGraphsThatTakeEverySize:
        def padded_size(self, num_tokens):
            return num_tokens

        def run(self, *args, **kwargs):
            raise AssertionError("a decode step went through the graphs cut at attention")

    model = str(make_tiny_model(tmp_path / "m", arch="llama", seed=3))
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64)
    core = llm.core
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for i in range(3):
        core.add_request(core.make_request(str(i), [7 + i] * (4 + i), params))
    core.step()                                  # the prompts: no cut graphs yet
    runner = core.runner
    assert runner.decode_graphs is not None and runner.piecewise is None
    runner.piecewise = CutGraphsThatTakeEverySize()
    before = runner.times.copy()
    while core.has_unfinished_requests():
        core.step()
    decode = runner.times.since(before)
    assert decode.steps >= 4
    assert decode.piecewise_steps == 0 and decode.piecewise_gpu == 0.0


def test_the_profiling_pass_keeps_its_positions_inside_the_rotary_tables(tmp_path):
    """The GPU sizes the KV pool after a forward pass of max_num_batched_tokens prompt tokens
    (on CPU it is skipped at start: run it here). Its positions ran 0..budget-1, past a model's
    max_position_embeddings when the budget is larger, and the fused rotary kernels index their
    tables [max_position_embeddings, D/2] by position unchecked."""
    import torch
    model = str(make_tiny_model(tmp_path / "m", arch="llama", seed=1,
                                max_position_embeddings=64))
    config = EngineConfig(model=model, dtype="float32", device="cpu", num_kv_blocks=16,
                          max_model_len=64, max_num_batched_tokens=200)
    runner = ModelRunner(config, torch.device("cpu"), torch.float32, [1])
    real, seen = runner.model, []

    class Recording:
        def __call__(self, ids, positions, caches, meta):
            seen.append(positions.clone())
            return real(ids, positions, caches, meta)

        def compute_logits(self, hidden):
            return real.compute_logits(hidden)
    runner.model = Recording()
    runner._profile_run()
    [positions] = seen
    assert len(positions) == 200 and 0 <= int(positions.min()) and int(positions.max()) < 64


GIB = 2 ** 30
BLOCK = 2 * 2 ** 20                 # an 8B model's block of 16 tokens, bf16


def _gpu(total, ours, others, peak):
    """mem_get_info's free, and PyTorch's reserved / allocated, for an engine that holds `ours`
    GiB through PyTorch (its weights and what the profiling pass left reserved) beside 1.3 GiB
    of its own CUDA context, on a GPU where other processes hold `others` GiB."""
    reserved, allocated = int(ours * GIB), int((ours - 1) * GIB)
    free = int(total * GIB) - reserved - int(1.3 * GIB) - int(others * GIB)
    return dict(total=int(total * GIB), free=free, reserved=reserved, allocated=allocated,
                peak=int(peak * GIB), block_bytes=BLOCK)


def test_gpu_memory_utilization_is_this_engines_share_whatever_others_hold():
    """vLLM V1's rule: the KV cache is the share less the engine's own weights and activations
    (PyTorch's peak); other processes' memory does not shrink it (vLLM V0's rule, ours before,
    took it off: 0.9 x 140 - 16 - others - the context)."""
    alone = kv_cache_blocks(**_gpu(140, 17, 0, 16), utilization=0.9)
    assert alone == (int(140 * GIB * 0.9) - 16 * GIB) // BLOCK
    assert kv_cache_blocks(**_gpu(140, 17, 10, 16), utilization=0.9) == alone
    # Two engines on one GPU at 0.45 each: the second sees the first's whole share held.
    first = kv_cache_blocks(**_gpu(140, 17, 0, 16), utilization=0.45)
    second = kv_cache_blocks(**_gpu(140, 17, 140 * 0.45 + 1.3, 16), utilization=0.45)
    assert first == second == (int(140 * GIB * 0.45) - 16 * GIB) // BLOCK


def _named(gpu, utilization):
    """The setting a refusal names, or None where it names none."""
    import re
    with pytest.raises(RuntimeError) as e:
        kv_cache_blocks(**gpu, utilization=utilization)
    found = re.search(r"at most (\S+), or set num_kv_blocks", str(e.value))
    return float(found.group(1)) if found else None


def test_a_share_other_processes_leave_no_room_for_is_refused_naming_the_most_it_can_be():
    gpu = _gpu(140, 17, 60, 16)               # others hold 60 GiB: ~62 GiB free
    with pytest.raises(RuntimeError, match="gpu_memory_utilization 0.9 leaves this engine's "
                       r"KV cache 110.00 GiB, but only 62.70 GiB .* lower "
                       r"gpu_memory_utilization to at most 0.54, or set num_kv_blocks"):
        kv_cache_blocks(**gpu, utilization=0.9)
    most = _named(gpu, 0.9)
    available = gpu["free"] + gpu["reserved"] - gpu["allocated"]
    blocks = kv_cache_blocks(**gpu, utilization=most)
    assert 0 < blocks * BLOCK <= available - SUGGESTION_HEADROOM * gpu["total"]
    # A share under the engine's own weights and activations: nothing is left for KV.
    with pytest.raises(RuntimeError, match=r"no memory left for the KV cache: "
                       r"gpu_memory_utilization 0.1 gives this engine 14.00 GiB .* weights and "
                       r"activations take 16.00: raise gpu_memory_utilization"):
        kv_cache_blocks(**_gpu(140, 17, 0, 16), utilization=0.1)


def test_where_other_processes_leave_no_room_at_any_setting_the_refusal_names_none():
    """(Found by review: the setting named was refused in turn, "raise" it.) Other processes
    leave 0.3 GiB beside the engine's weights and activations: no setting gives it a KV cache
    with room for the graphs."""
    gpu = _gpu(140, 17, 140 - 17 - 1.3 - 0.3 - 1, 16)
    with pytest.raises(RuntimeError, match="no gpu_memory_utilization leaves this engine room "
                       "for a KV cache beside them: free the GPU of other processes"):
        kv_cache_blocks(**gpu, utilization=0.9)


def test_a_setting_a_refusal_names_is_taken():
    """Over random GPUs: a setting that a refusal names gives a KV cache of a block or more
    that leaves the headroom free."""
    import random
    rng = random.Random(0)
    named = 0
    for _ in range(3000):
        total = rng.choice([24, 80, 94, 141, 192])
        peak = rng.uniform(0.5, total * 0.6)
        gpu = _gpu(total, peak + rng.uniform(0.1, 2), rng.uniform(0, total - peak - 4), peak)
        utilization = rng.choice([0.5, 0.8, 0.9, 0.95, 1.0])
        try:
            kv_cache_blocks(**gpu, utilization=utilization)
            continue
        except RuntimeError:
            pass
        most = _named(gpu, utilization)
        if most is None:
            continue
        named += 1
        blocks = kv_cache_blocks(**gpu, utilization=most)
        available = gpu["free"] + gpu["reserved"] - gpu["allocated"]
        assert 1 <= blocks and blocks * BLOCK <= available - SUGGESTION_HEADROOM * gpu["total"]
    assert named > 500
