"""ModelRunner pieces that the engine tests do not reach on CPU."""
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
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
