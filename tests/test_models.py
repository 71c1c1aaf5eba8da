"""engine/models: our paged Llama/Mistral/Qwen2 against HF transformers on tiny random models,
the checkpoint loader, and ModelConfig parsing."""
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from engine.models.attention import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.llama import RMSNorm, RotaryEmbedding, apply_rotary, compute_inv_freq
from engine.models.loader import load_model

ATOL, RTOL = 1e-4, 1.3e-6  # float32
SMALL = dict(vocab_size=96, hidden_size=48, intermediate_size=80, max_position_embeddings=256)
VARIANTS = {
    # head_dim != hidden / heads, GQA 2, every bias, llama3 rope whose three bands are all used.
    "llama": lambda: LlamaConfig(
        **SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 2.0, "original_max_position_embeddings": 64},
    ),
    "qwen2": lambda: Qwen2Config(
        **SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
    ),
    "qwen2_window": lambda: Qwen2Config(
        **SMALL, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        use_sliding_window=True, sliding_window=6, max_window_layers=1,
    ),
    "mistral": lambda: MistralConfig(
        **SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, sliding_window=None,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    # A "llamafied" Mistral's leftover key: Llama has no sliding window (HF and vLLM ignore it).
    "llama_stray_window": lambda: LlamaConfig(
        **SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
    ),
    "mistral_window": lambda: MistralConfig(
        **SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=7,
    ),
}


def make_hf_model(hf_config, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    with torch.no_grad():  # biases and norm weights too, so that every parameter matters
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_and_ours(request, tmp_path_factory):
    hf = make_hf_model(VARIANTS[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours, config = load_model(path, torch.float32, torch.device("cpu"))
    return hf, ours, config, path


def hf_logits(hf, token_ids):
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0]


class PagedKV:
    """The runner's job in miniature: a pool of blocks handed out in random order, a block
    table per sequence, and the metadata of one step."""

    def __init__(self, config, num_blocks=64, block_size=5, seed=0):
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
        self.blocks, self.num_cached = {}, {}

    def step(self, chunks, num_padding=0):
        """chunks: [(seq_id, new token ids)] -> (input_ids, positions, AttentionMetadata)."""
        ids, positions, slots, cu, seq_lens = [], [], [], [0], []
        for seq_id, new_tokens in chunks:
            start = self.num_cached.get(seq_id, 0)
            blocks = self.blocks.setdefault(seq_id, [])
            for pos in range(start, start + len(new_tokens)):
                if pos // self.block_size == len(blocks):
                    blocks.append(self.free.pop())
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids += new_tokens
            positions += range(start, start + len(new_tokens))
            self.num_cached[seq_id] = start + len(new_tokens)
            cu.append(len(ids))
            seq_lens.append(self.num_cached[seq_id])
        ids += [0] * num_padding
        positions += [0] * num_padding
        slots += [-1] * num_padding
        max_blocks = max(len(self.blocks[seq_id]) for seq_id, _ in chunks)
        table = [self.blocks[s] + [0] * (max_blocks - len(self.blocks[s])) for s, _ in chunks]
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_table=torch.tensor(table, dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            max_seqlen_q=max(len(t) for _, t in chunks),
            max_seqlen_k=max(seq_lens),
        )
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), attn


def run_step(model, kv, chunks, num_padding=0):
    """One forward; returns each chunk's logits."""
    input_ids, positions, attn = kv.step(chunks, num_padding)
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, positions, kv.kv_caches, attn))
    cu = attn.cu_seqlens_q.tolist()
    return [logits[cu[i]: cu[i + 1]] for i in range(len(chunks))]


def random_tokens(n, seed):
    return torch.randint(0, SMALL["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_whole_prompt_matches_hf(hf_and_ours):
    hf, ours, config, _ = hf_and_ours
    prompt = random_tokens(29, seed=1)
    (logits,) = run_step(ours, PagedKV(config), [(0, prompt)])
    expected = hf_logits(hf, prompt)
    assert expected.std() > 0.5  # logits spread, so agreement means something
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)


def test_chunked_prefill_then_decode_matches_hf(hf_and_ours):
    hf, ours, config, _ = hf_and_ours
    tokens = random_tokens(32, seed=2)
    kv = PagedKV(config, seed=3)
    got = []
    for chunk in (tokens[:11], tokens[11:19], tokens[19:26]):  # prefill in three chunks
        got += run_step(ours, kv, [(0, chunk)])
    for token in tokens[26:]:  # then decode one token at a time
        got += run_step(ours, kv, [(0, [token])])
    torch.testing.assert_close(torch.cat(got), hf_logits(hf, tokens), atol=ATOL, rtol=RTOL)


def test_mixed_batch_matches_each_sequence_alone(hf_and_ours):
    hf, ours, config, _ = hf_and_ours
    seqs = {0: random_tokens(23, seed=4), 1: random_tokens(30, seed=5), 2: random_tokens(12, seed=6)}
    kv = PagedKV(config, seed=7)
    run_step(ours, kv, [(1, seqs[1][:20]), (2, seqs[2][:11])])  # earlier context of 1 and 2
    # A whole prompt, a later chunk and a decode row in one step, then two padding rows.
    got = run_step(ours, kv, [(0, seqs[0]), (1, seqs[1][20:]), (2, seqs[2][11:])], num_padding=2)
    torch.testing.assert_close(got[0], hf_logits(hf, seqs[0]), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got[1], hf_logits(hf, seqs[1])[20:], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got[2], hf_logits(hf, seqs[2])[11:], atol=ATOL, rtol=RTOL)


def test_fp8_kv_cache_stays_near_hf(hf_and_ours):
    """An FP8 KV cache (EngineConfig.kv_cache_dtype="fp8") rounds every key and value to e4m3
    (3 mantissa bits): the logits leave HF's, but stay near them, through chunked prefill and
    decode (the CPU path; the kernels are held to the same reference in their own tests)."""
    hf, ours, config, _ = hf_and_ours
    tokens = random_tokens(32, seed=2)
    kv = PagedKV(config)
    kv.kv_caches = [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in kv.kv_caches]
    got = torch.cat([run_step(ours, kv, [(0, tokens[:20])])[0], run_step(ours, kv, [(0, tokens[20:29])])[0]]
                    + [run_step(ours, kv, [(0, [t])])[0] for t in tokens[29:]])
    expected = hf_logits(hf, tokens)
    # Measured on these five models: mean |error| 3-6% of the logits' spread, the largest 19-44%
    # (one e4m3 rounding is up to 6% of a value).
    err = (got - expected).abs() / expected.std()
    assert 0 < err.mean() < 0.1 and err.max() < 0.6, (err.mean(), err.max())
    assert kv.kv_caches[0][0].dtype == torch.float8_e4m3fn and kv.kv_caches[0][0].float().abs().sum() > 0


def test_rotary_and_window_config_match_hf(hf_and_ours):
    hf, ours, config, _ = hf_and_ours
    assert torch.equal(ours.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    windows = [layer.self_attn.attn.sliding_window for layer in ours.layers]
    hf_windows = [getattr(layer.self_attn, "sliding_window", None) for layer in hf.model.layers]
    if config.architecture == "MistralForCausalLM":  # Mistral's window lives on the config
        hf_windows = [hf.config.sliding_window] * len(windows)
    assert windows == hf_windows


def test_llama3_rope_scaling_bites():
    scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
               "original_max_position_embeddings": 64}
    plain = compute_inv_freq(16, 10000.0, None)
    scaled = compute_inv_freq(16, 10000.0, scaling)
    ratio = (plain / scaled).tolist()
    assert ratio[:2] == [1.0, 1.0]  # short wavelengths kept
    assert 1.0 < ratio[2] < 4.0  # one interpolated band
    assert ratio[3:] == pytest.approx([4.0] * 5)  # long wavelengths divided by the factor


def test_rmsnorm_and_rotary_bitwise_equal_hf_in_bf16(hf_and_ours):
    """In bf16, HF normalizes in fp32, casts, *then* multiplies by the weight; cos/sin are made
    in fp32 and cast. Any other order shows up as different bits."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    hf, _, config, _ = hf_and_ours
    gen = torch.Generator().manual_seed(8)
    x = (3 * torch.randn(7, config.hidden_size, generator=gen)).bfloat16()
    ours, theirs = RMSNorm(config.hidden_size, 1e-6), LlamaRMSNorm(config.hidden_size, 1e-6)
    with torch.no_grad():
        ours.weight.copy_(1 + torch.randn(config.hidden_size, generator=gen))
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.bfloat16(), theirs.bfloat16()
    assert torch.equal(ours(x), theirs(x))

    positions = torch.tensor([0, 1, 5, 17, 63, 64, 200])
    rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling).bfloat16()
    cos, sin = rotary(positions, torch.bfloat16)
    hf_cos, hf_sin = hf.model.rotary_emb(x[None], positions[None])
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    q = torch.randn(7, 3, config.head_dim, generator=gen).bfloat16()
    hf_q, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], hf_cos, hf_sin)
    assert torch.equal(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1))


def test_sharded_checkpoint_loads_identically(tmp_path):
    hf = make_hf_model(VARIANTS["llama"]())
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    single, _ = load_model(tmp_path / "single", torch.float32, "cpu")
    sharded, _ = load_model(tmp_path / "sharded", torch.float32, "cpu", load_format="safetensors")
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


def test_load_in_bf16_keeps_rotary_in_fp32(hf_and_ours):
    _, ours, config, path = hf_and_ours
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.rotary_emb.inv_freq, ours.rotary_emb.inv_freq)
    assert torch.equal(model.embed_tokens.weight, ours.embed_tokens.weight.bfloat16())


def test_logits_into_a_float32_buffer_equal_the_float32_logits(hf_and_ours):
    # The decode graphs convert bf16 logits into their float32 buffer (no float32 temporary):
    # the same values as compute_logits' own float32 tensor, and the buffer is what is returned.
    _, _, config, path = hf_and_ours
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    hidden = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = model.compute_logits(hidden)
    assert want.dtype == torch.float32 and want.shape == (5, config.vocab_size)
    buf = torch.full((5, config.vocab_size), float("nan"))
    got = model.compute_logits(hidden, out=buf)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, want)
    # Rounded to bf16 first, as transformers' lm_head in bf16 gives them.
    assert torch.equal(want, want.bfloat16().float())
    # A buffer of the model's dtype is written by the lm_head itself: the same values.
    buf16 = torch.full((5, config.vocab_size), float("nan"), dtype=torch.bfloat16)
    got16 = model.compute_logits(hidden, out=buf16)
    assert got16.data_ptr() == buf16.data_ptr() and torch.equal(got16.float(), want)


def copy_checkpoint(src, dst, drop=(), config_changes=None):
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    raw.update(config_changes or {})
    (dst / "config.json").write_text(json.dumps(raw))
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k not in drop}, dst / "model.safetensors")


def test_missing_weight_is_named(hf_and_ours, tmp_path):
    path = hf_and_ours[3]
    copy_checkpoint(path, tmp_path / "m", drop={"model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match=r"lacks 1 expected weight\(s\): model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path / "m", torch.float32, "cpu")


def test_shape_mismatch_is_named(hf_and_ours, tmp_path):
    path = hf_and_ours[3]
    copy_checkpoint(path, tmp_path / "m", config_changes={"intermediate_size": 64})
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight' .* has shape .*80.*expects .*64"):
        load_model(tmp_path / "m", torch.float32, "cpu")


def save_llama_config_only(path):
    hf_config = VARIANTS["llama"]()
    hf_config.architectures = ["LlamaForCausalLM"]
    hf_config.save_pretrained(path)


def test_no_weight_files(tmp_path):
    save_llama_config_only(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"no safetensors weights.*{tmp_path.name}"):
        load_model(tmp_path, torch.float32, "cpu")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "shard-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="shard-1.safetensors"):
        load_model(tmp_path, torch.float32, "cpu")


def test_bad_folder_architecture_and_load_format(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        load_model(tmp_path / "nowhere", torch.float32, "cpu")
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path, torch.float32, "cpu")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        load_model(tmp_path, torch.float32, "cpu")
    with pytest.raises(ValueError, match="'pt'.*auto, safetensors, dummy"):
        load_model(tmp_path, torch.float32, "cpu", load_format="pt")


def test_dummy_load_needs_only_config(tmp_path):
    save_llama_config_only(tmp_path)
    torch.manual_seed(0)
    model, config = load_model(tmp_path, torch.bfloat16, "cpu", load_format="dummy")
    torch.manual_seed(0)
    again, _ = load_model(tmp_path, torch.bfloat16, "cpu", load_format="dummy")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.shape == ((4 + 2 * 2) * 16, 48) and qkv.bias.shape == ((4 + 2 * 2) * 16,)
    assert model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 80, 48)
    assert model.lm_head.weight.shape == (96, 48)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert 0 < model.layers[1].mlp.down_proj.weight.abs().max() <= 1e-3
    kv = PagedKV(config)
    kv.kv_caches = [(k.bfloat16(), v.bfloat16()) for k, v in kv.kv_caches]
    (logits,) = run_step(model, kv, [(0, [1, 2, 3])])
    assert logits.dtype == torch.float32 and logits.shape == (3, 96) and logits.isfinite().all()


BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": None,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 512}


def test_config_transformers4_and_5_keys_agree(tmp_path):
    v4 = dict(BASE_CONFIG, rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3}, torch_dtype="bfloat16")
    v5 = dict(BASE_CONFIG, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}, dtype="bfloat16")
    for name, raw in (("v4", v4), ("v5", v5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
    (tmp_path / "v5" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    a, b = ModelConfig.from_pretrained(tmp_path / "v4"), ModelConfig.from_pretrained(tmp_path / "v5")
    assert b.eos_token_ids == [2, 7] and a.eos_token_ids == [2]
    assert a == ModelConfig.from_dict(v5, {"eos_token_id": 2})
    assert a.rope_theta == 500000.0 and a.rope_scaling == {"rope_type": "llama3", **LLAMA3}
    assert a.head_dim == 16 and a.torch_dtype == "bfloat16" and a.sliding_window is None
    # Both keys: transformers takes `dtype` and `torch_dtype` only where `dtype` is null.
    assert ModelConfig.from_dict(dict(v5, torch_dtype="float16")).torch_dtype == "bfloat16"
    assert ModelConfig.from_dict(dict(v4, dtype=None)).torch_dtype == "bfloat16"
    legacy = ModelConfig.from_dict(dict(BASE_CONFIG, rope_scaling={"type": "linear", "factor": 2}))
    assert legacy.rope_scaling == {"rope_type": "linear", "factor": 2.0} and legacy.rope_theta == 10000.0
    plain = ModelConfig.from_dict(dict(BASE_CONFIG, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert plain.rope_scaling is None and plain.rope_theta == 1e6


def test_context_length_counts_a_linear_rope_factor_as_vllm_does():
    """vLLM derives a linearly RoPE-scaled model's context as max_position_embeddings x factor
    (vicuna-7b-v1.5-16k: 4096 x 4); a llama3-scaled model's max_position_embeddings already
    counts its factor."""
    linear = ModelConfig.from_dict(dict(BASE_CONFIG, rope_scaling={"type": "linear", "factor": 4}))
    assert linear.max_context_len == 4 * 4096
    llama3 = ModelConfig.from_dict(dict(BASE_CONFIG, rope_scaling={"rope_type": "llama3", **LLAMA3}))
    assert llama3.max_context_len == 4096
    assert ModelConfig.from_dict(BASE_CONFIG).max_context_len == 4096


def test_fused_rotary_tables_reach_a_linear_rope_models_whole_context(tmp_path):
    """The fused rotary kernel (interpreted on CPU) indexes its tables by position unchecked:
    past max_position_embeddings, up to the scaled context, the logits are still HF's."""
    from tests.kernel_support import require_runnable
    import kernels.rotary
    require_runnable(kernels.rotary)
    hf = make_hf_model(LlamaConfig(
        **dict(SMALL, max_position_embeddings=16), num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}))
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.max_context_len == 32
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"), fused_kernels=True)
    tokens = random_tokens(30, seed=3)
    kv = PagedKV(config, block_size=16, seed=4)
    got = run_step(model, kv, [(0, tokens[:20])]) + [run_step(model, kv, [(0, [t])])[0] for t in tokens[20:]]
    torch.testing.assert_close(torch.cat(got), hf_logits(hf, tokens), atol=ATOL, rtol=RTOL)


def test_a_single_weights_file_wins_over_an_index_of_shards_as_in_hf(tmp_path):
    """A folder with model.safetensors and a (stale) index of shards: transformers loads the
    single file; so does the loader, so both serve the same weights."""
    single, stale = make_hf_model(VARIANTS["llama"](), seed=0), make_hf_model(VARIANTS["llama"](), seed=1)
    single.save_pretrained(tmp_path / "m")
    stale.save_pretrained(tmp_path / "shards", max_shard_size="20KB")
    for f in (tmp_path / "shards").iterdir():
        if f.name.endswith((".safetensors", ".index.json")):
            shutil.copy(f, tmp_path / "m" / f.name)
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    ours, _ = load_model(tmp_path / "m", torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert torch.equal(ours.layers[0].self_attn.o_proj.weight, hf.model.layers[0].self_attn.o_proj.weight)
    assert torch.equal(hf.model.layers[0].self_attn.o_proj.weight, single.model.layers[0].self_attn.o_proj.weight)


def test_config_eos_ids_are_generation_configs_where_it_names_them():
    """transformers' generate and vLLM stop on generation_config.json's eos ids when the file
    names them; not on config.json's too (its id may be a token the model generates, as in some
    fine-tunes). Where the file names none, config.json's, as vLLM stops on the tokenizer's EOS
    then (transformers' generate stops on none)."""
    raw = dict(BASE_CONFIG, eos_token_id=2)
    assert ModelConfig.from_dict(raw, {"eos_token_id": [5, 6]}).eos_token_ids == [5, 6]
    assert ModelConfig.from_dict(raw, {"eos_token_id": 7}).eos_token_ids == [7]
    assert ModelConfig.from_dict(raw, {"eos_token_id": None}).eos_token_ids == [2]
    assert ModelConfig.from_dict(raw, {"bos_token_id": 1}).eos_token_ids == [2]
    assert ModelConfig.from_dict(dict(raw, eos_token_id=[2, 3, 2])).eos_token_ids == [2, 3]


def test_config_takes_swish_as_silu_and_refuses_other_activations():
    assert ModelConfig.from_dict(dict(BASE_CONFIG, hidden_act="swish")) == ModelConfig.from_dict(
        dict(BASE_CONFIG, hidden_act="silu"))
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'; supported: 'silu'"):
        ModelConfig.from_dict(dict(BASE_CONFIG, hidden_act="gelu"))


def test_config_flags_per_architecture():
    qwen = ModelConfig.from_dict(dict(BASE_CONFIG, architectures=["Qwen2ForCausalLM"], attention_bias=False,
                                      sliding_window=32, use_sliding_window=False, tie_word_embeddings=True))
    assert (qwen.qkv_bias, qwen.o_bias, qwen.sliding_window, qwen.tie_word_embeddings) == (True, False, None, True)
    mistral = ModelConfig.from_dict(dict(BASE_CONFIG, architectures=["MistralForCausalLM"], sliding_window=32))
    assert mistral.sliding_window == 32 and mistral.sliding_window_layers == (0, 1)
    # transformers-4 Qwen2 configs carry no layer_types: layers from max_window_layers on slide.
    qwen_window = dict(BASE_CONFIG, architectures=["Qwen2ForCausalLM"], num_hidden_layers=4,
                       sliding_window=32, use_sliding_window=True, max_window_layers=1)
    assert ModelConfig.from_dict(qwen_window).sliding_window_layers == (1, 2, 3)
    qwen_window["layer_types"] = ["sliding_attention", "full_attention"] * 2
    assert ModelConfig.from_dict(qwen_window).sliding_window_layers == (0, 2)
    llama = ModelConfig.from_dict(dict(BASE_CONFIG, attention_bias=True, mlp_bias=True))
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (True, True, True)
    # transformers' Mistral has no biases whatever the flags say (its layers are built
    # without them), nor does Qwen2 beyond q, k and v.
    for arch, biases in (("MistralForCausalLM", (False, False, False)),
                         ("Qwen2ForCausalLM", (True, False, False))):
        c = ModelConfig.from_dict(dict(BASE_CONFIG, architectures=[arch], attention_bias=True,
                                       mlp_bias=True))
        assert (c.qkv_bias, c.o_bias, c.mlp_bias) == biases, arch
    stray = ModelConfig.from_dict(dict(BASE_CONFIG, sliding_window=32))
    assert (stray.sliding_window, stray.sliding_window_layers) == (None, ())


def test_config_reads_absent_keys_as_the_architectures_hf_config_does():
    """transformers' config class of each architecture fills a key the file leaves out with its
    own default (Mistral's window 4096, 131,072 positions; Qwen2's 32,768); an explicit null
    window stays no window. Without `architectures` the class comes from `model_type`."""
    from transformers import AutoConfig
    base = {k: v for k, v in BASE_CONFIG.items()
            if k not in ("architectures", "max_position_embeddings", "head_dim")}
    for arch, model_type, extra in (("LlamaForCausalLM", "llama", {}),
                                    ("MistralForCausalLM", "mistral", {}),
                                    ("Qwen2ForCausalLM", "qwen2", {"use_sliding_window": True})):
        raw = dict(base, architectures=[arch], **extra)
        hf = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "architectures"})
        ours = ModelConfig.from_dict(raw)
        assert (ours.sliding_window, ours.max_position_embeddings, ours.num_key_value_heads) == (
            getattr(hf, "sliding_window", None), hf.max_position_embeddings, hf.num_key_value_heads), arch
        assert ModelConfig.from_dict(dict(base, model_type=model_type, **extra)) == ours
    mistral = dict(base, architectures=["MistralForCausalLM"], sliding_window=None)
    assert ModelConfig.from_dict(mistral).sliding_window is None
    assert ModelConfig.from_dict(dict(base, architectures=["MistralForCausalLM"])).num_key_value_heads == 2
    with pytest.raises(ValueError, match="`architectures` is absent and `model_type` is 'gpt2'.*llama, mistral, qwen2"):
        ModelConfig.from_dict(dict(base, model_type="gpt2"))


@pytest.mark.parametrize("stored", ["distinct lm_head", "lm_head only"])
def test_a_tied_config_loads_its_checkpoints_head_as_hf_does(tmp_path, stored):
    """tie_word_embeddings, but the checkpoint ships an lm_head.weight: where it differs from
    embed_tokens transformers does not tie them (it warns), and where it is the only copy it fills
    embed_tokens from it. The logits equal HF's either way."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    make_hf_model(cfg).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    if stored == "distinct lm_head":
        tensors["lm_head.weight"] = 0.15 * torch.randn(tensors["model.embed_tokens.weight"].shape,
                                                       generator=torch.Generator().manual_seed(5))
    else:
        tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours, config = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert config.tie_word_embeddings == (stored == "lm_head only")
    prompt = list(range(3, 40))
    (logits,) = run_step(ours, PagedKV(config), [(0, prompt)])
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1.3e-6)


def test_config_rejects_unsupported_rope():
    with pytest.raises(ValueError, match="'yarn'.*default, linear, llama3"):
        ModelConfig.from_dict(dict(BASE_CONFIG, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="'low_freq_factor'"):
        ModelConfig.from_dict(dict(BASE_CONFIG, rope_scaling={"rope_type": "llama3", "factor": 4.0}))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


@pytest.mark.parametrize("scaling, named", [
    ({"rope_type": "linear", "factor": None}, "'factor' must be a number > 0, got None"),
    ({"rope_type": "linear", "factor": 0}, "'factor' must be a number > 0, got 0"),
    ({"rope_type": "linear", "factor": -2.0}, "'factor' must be a number > 0, got -2.0"),
    ({"rope_type": "linear", "factor": "4"}, "'factor' must be a number > 0, got '4'"),
    (LLAMA3 | {"low_freq_factor": None}, "'low_freq_factor' must be a number > 0, got None"),
    (LLAMA3 | {"high_freq_factor": 1.0}, "'high_freq_factor' must be greater than"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor 0.5 is not supported"),
], ids=["null", "zero", "negative", "text", "llama3 null", "llama3 equal", "partial"])
def test_config_names_a_bad_rope_parameter(scaling, named):
    """A null factor escaped as float()'s bare TypeError; a zero or negative one was taken
    and gave the model a context of 0 or less tokens (and inf / NaN frequencies); llama3's
    smoothing divides by high - low; HF's scaled ropes take a partial rotary factor and then
    fail on the shapes."""
    with pytest.raises(ValueError, match=re.escape(named)):
        ModelConfig.from_dict(dict(BASE_CONFIG, rope_scaling=scaling))


# The Triton attention kernel takes head dims 16, 32, ...: llama, and a Qwen2 with one KV head
# and a sliding window on some layers.
TRITON_VARIANTS = {
    "llama": VARIANTS["llama"],
    "qwen2_window": lambda: Qwen2Config(
        **SMALL, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        use_sliding_window=True, sliding_window=6, max_window_layers=1,
    ),
}


@pytest.fixture(scope="module", params=list(TRITON_VARIANTS))
def hf_and_path_d16(request, tmp_path_factory):
    hf = make_hf_model(TRITON_VARIANTS[request.param]())
    path = tmp_path_factory.mktemp(request.param + "_d16")
    hf.save_pretrained(path)
    return hf, ModelConfig.from_pretrained(path), path


def test_fused_rope_kv_write_path_equals_two_kernel_path(hf_and_path_d16):
    """The Triton path (kernels interpreted on CPU): with fuse_rope_kv_write each layer rotates q
    and k and writes the KV cache in one kernel instead of rotary + write_kv, and the logits and
    caches are bitwise those of the two kernels (and HF's within fp32 tolerance)."""
    import dataclasses

    import kernels.rotary_write_kv
    from engine.models.attention import triton_backend
    from tests.kernel_support import require_runnable
    require_runnable(kernels.rotary_write_kv)
    hf, config, path = hf_and_path_d16
    assert config.head_dim == 16
    tokens = random_tokens(24, seed=8)
    results = {}
    for fuse in (False, True):
        calls = {"write_kv": 0, "rotary_write_kv": 0}

        def counted(name, fn):
            def run(*args, **kwargs):
                calls[name] += 1
                return fn(*args, **kwargs)
            return run
        backend = triton_backend()
        backend = dataclasses.replace(backend, write_kv=counted("write_kv", backend.write_kv),
                                      rotary_write_kv=counted("rotary_write_kv", backend.rotary_write_kv))
        model, _ = load_model(path, torch.float32, torch.device("cpu"), attention_backend=backend,
                              fused_kernels=True, fuse_rope_kv_write=fuse)
        kv = PagedKV(config, block_size=16, seed=9)
        got = run_step(model, kv, [(0, tokens[:13]), (1, tokens[:5])], num_padding=2)[:1]
        got += run_step(model, kv, [(0, tokens[13:20]), (1, [tokens[5]])])[:1]
        for token in tokens[20:]:
            got += run_step(model, kv, [(0, [token])])
        results[fuse] = torch.cat(got), kv.kv_caches
        num_calls = (2 + len(tokens[20:])) * config.num_hidden_layers
        assert calls == ({"write_kv": 0, "rotary_write_kv": num_calls} if fuse
                         else {"write_kv": num_calls, "rotary_write_kv": 0})
    (unfused, unfused_kv), (fused, fused_kv) = results[False], results[True]
    assert torch.equal(fused, unfused)
    for (k0, v0), (k1, v1) in zip(unfused_kv, fused_kv):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    torch.testing.assert_close(fused, hf_logits(hf, tokens), atol=ATOL, rtol=RTOL)


def test_norms_merging_the_projections_split_k_partials_give_the_same_bits(hf_and_path_d16, monkeypatch):
    """model.late_merge (EngineConfig.decode_late_merge), on the Triton path (kernels
    interpreted on CPU, every projection given a split-K skinny config for every row bucket): in
    steps of up to 16 rows qkv_proj hands its K-slice partials to the rotary + KV-write kernel,
    o_proj and down_proj theirs to the RMSNorm after them, and each merges them as it reads
    them; the logits and KV caches are bitwise those of the GEMMs' own merge (and the logits
    HF's within fp32 tolerance). Larger steps (the prompt chunks) run F.linear either way."""
    import dataclasses
    import engine.models.linear as linear_module
    import engine.models.llama as llama_module
    from engine.models.attention import triton_backend
    from engine.models.linear import ROW_BUCKETS, Linear
    from tests.kernel_support import load_kernels, require_runnable
    sg, rms = load_kernels("kernels.skinny_gemm"), load_kernels("kernels.rmsnorm")
    require_runnable(sg)
    require_runnable(rms)
    norms_of_parts, rotary_of_parts = [], []

    def norm(*args, **kw):
        norms_of_parts.append(kw.get("x_parts") is not None)
        return rms.rms_norm(*args, **kw)

    plain = triton_backend()

    def rotary_write_kv(*args, **kw):
        rotary_of_parts.append(kw.get("qkv_parts") is not None)
        return plain.rotary_write_kv(*args, **kw)
    backend = dataclasses.replace(plain, rotary_write_kv=rotary_write_kv)
    monkeypatch.setattr(linear_module, "skinny_gemm", sg.skinny_gemm)
    monkeypatch.setattr(llama_module, "rms_norm", norm)
    hf, config, path = hf_and_path_d16
    layers = config.num_hidden_layers
    tokens = random_tokens(24, seed=12)
    results = {}
    for late_merge in (False, True):
        model, _ = load_model(path, torch.float32, torch.device("cpu"), attention_backend=backend,
                              fused_kernels=True)
        for lin in model.modules():
            if isinstance(lin, Linear):
                lin.skinny = {b: sg.SkinnyConfig(16, 16, 3) for b in ROW_BUCKETS}
        model.late_merge = late_merge
        kv = PagedKV(config, block_size=16, seed=13)
        norms_of_parts.clear()
        rotary_of_parts.clear()
        got = run_step(model, kv, [(0, tokens[:20]), (1, tokens[:3])])[:1]    # 23 rows: F.linear
        assert norms_of_parts == [False] * (2 * layers + 1) and rotary_of_parts == [False] * layers
        for token in tokens[20:]:
            norms_of_parts.clear()
            rotary_of_parts.clear()
            got += run_step(model, kv, [(0, [token]), (1, [token])])[:1]       # 2 rows: skinny
            # the first layer's input norm reads the embedding; every other norm a projection's
            assert norms_of_parts == [False] + [late_merge] * (2 * layers)
            assert rotary_of_parts == [late_merge] * layers
        results[late_merge] = torch.cat(got), kv.kv_caches
    (merged, merged_kv), (late, late_kv) = results[False], results[True]
    assert torch.equal(late, merged)
    for (k0, v0), (k1, v1) in zip(merged_kv, late_kv):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    torch.testing.assert_close(late, hf_logits(hf, tokens), atol=ATOL, rtol=RTOL)
