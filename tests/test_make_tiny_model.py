"""scripts/make_tiny_model.py: loadable folders, configs as specified, determinism, sharding,
byte-level tokenizer round trips, and logits spread enough for greedy comparisons."""
import json
import math
import unicodedata

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from scripts.make_tiny_model import (ARCHS, BOS_TOKEN, CORPUS_PATH, main, make_tiny_model,
                                     train_tokenizer)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM"}
HEAD_DIMS = {"llama": 32, "qwen2": 16, "mistral": 16}
ROPE_PARAMETERS = {
    "llama": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64},
    "qwen2": {"rope_type": "default", "rope_theta": 1000000.0},
    "mistral": {"rope_type": "default", "rope_theta": 10000.0},
}
TIED = {"llama": False, "qwen2": True, "mistral": False}

# NFC text only: the qwen2 tokenizer normalizes to NFC (checked separately below).
ROUND_TRIP_TEXTS = [
    "Hello, world! The keeper's ledger: 7 boats, 112 steps.",
    "café naïve Zürich crème brûlée Łódź Dvořák",
    "Καλημέρα κόσμε · Доброе утро, мир",
    "中文 日本語 こんにちは 我的朋友 안녕하세요",
    "emoji 😀🎉👍🏽 🧑\u200d🚒 ❤️ 🦀 and symbols ∀x ∈ ℝ, x² ≥ 0 → €12.50",
    "  leading spaces, two  inner,\ttab\nnewline\r\n  trailing  ",
    "def f(x):\n    return {'a': [x ** 2, x // 3]}  # comment",
    " . , ! ? ' \" ` ~ @ # $ % ^ & * ( ) [ ] { } < >",
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch=arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="module")
def loaded(model_dirs):
    """arch -> (tokenizer, model) loaded through the Auto classes, as users will."""
    return {arch: (AutoTokenizer.from_pretrained(path),
                   AutoModelForCausalLM.from_pretrained(path).eval())
            for arch, path in model_dirs.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_folder_loads_with_configured_architecture(arch, model_dirs, loaded):
    path = model_dirs[arch]
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    config = AutoConfig.from_pretrained(path)
    tok, model = loaded[arch]
    assert config.model_type == arch
    assert config.architectures == [ARCHITECTURES[arch]]
    assert type(model).__name__ == ARCHITECTURES[arch]
    assert model.dtype == torch.float32
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (64, 128, 3)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert (config.rms_norm_eps, config.max_position_embeddings) == (1e-5, 1024)
    assert config.vocab_size == len(tok)
    assert (config.bos_token_id, config.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    generation_config = GenerationConfig.from_pretrained(path)
    assert (generation_config.bos_token_id, generation_config.eos_token_id) == (
        tok.bos_token_id, tok.eos_token_id)

    attn = model.model.layers[0].self_attn
    head_dim = HEAD_DIMS[arch]
    assert attn.q_proj.weight.shape == (4 * head_dim, 64)
    assert attn.k_proj.weight.shape == (2 * head_dim, 64)
    assert attn.o_proj.weight.shape == (64, 4 * head_dim)

    raw = json.loads((path / "config.json").read_text())
    assert raw["rope_parameters"] == ROPE_PARAMETERS[arch]
    assert "rope_scaling" not in raw and "rope_theta" not in raw
    assert raw["tie_word_embeddings"] is TIED[arch]
    if arch == "mistral":
        assert raw["sliding_window"] is None
    if arch == "qwen2":
        assert raw["use_sliding_window"] is False and raw["sliding_window"] is None

    tensors = load_file(path / "model.safetensors")
    assert ("lm_head.weight" in tensors) is not TIED[arch]
    assert (model.lm_head.weight.data_ptr() ==
            model.model.embed_tokens.weight.data_ptr()) is TIED[arch]
    bias_names = {n for n in tensors if n.endswith(".bias")}
    if arch == "qwen2":
        assert bias_names == {f"model.layers.{i}.self_attn.{p}_proj.bias"
                              for i in range(3) for p in "qkv"}
        assert all(tensors[n].abs().max() > 0 for n in bias_names)
    else:
        assert bias_names == set()
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.1 and norm.std() > 0.01


def _inv_freq_ref(rope: dict, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama 3's frequency-dependent rescaling when asked for."""
    inv_freq = 1.0 / rope["rope_theta"] ** (
        torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if rope["rope_type"] == "default":
        return inv_freq
    old_len, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen < old_len / high, inv_freq,
                       torch.where(wavelen > old_len / low, inv_freq / factor, interpolated))


@pytest.mark.parametrize("arch", ARCHS)
def test_rotary_frequencies_follow_rope_parameters(arch, loaded):
    inv_freq = loaded[arch][1].model.rotary_emb.inv_freq.double()
    ref = _inv_freq_ref(ROPE_PARAMETERS[arch], HEAD_DIMS[arch])
    torch.testing.assert_close(inv_freq, ref, rtol=1e-5, atol=0)
    if arch == "llama":
        unscaled = _inv_freq_ref({"rope_type": "default", "rope_theta": 500000.0}, 32)
        ratio = unscaled / inv_freq
        # original_max_position_embeddings=64 puts frequencies in all three llama3 regimes.
        assert (ratio - 1).abs().min() < 1e-5          # kept
        assert (ratio - 8).abs().min() < 1e-4          # divided by factor
        assert ((ratio > 1.01) & (ratio < 7.99)).any()  # interpolated


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_gives_identical_bytes(arch, model_dirs, tmp_path):
    again = make_tiny_model(tmp_path / "again", arch=arch, seed=0)
    names = sorted(p.name for p in model_dirs[arch].iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (again / name).read_bytes() == (model_dirs[arch] / name).read_bytes(), name


def test_different_seed_changes_every_weight_not_the_tokenizer(model_dirs, tmp_path):
    other = make_tiny_model(tmp_path / "seed1", arch="llama", seed=1)
    assert ((other / "tokenizer.json").read_bytes() ==
            (model_dirs["llama"] / "tokenizer.json").read_bytes())
    a = load_file(model_dirs["llama"] / "model.safetensors")
    b = load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert not torch.equal(a[name], b[name]), name


def test_small_max_shard_size_writes_shards_and_index(model_dirs, tmp_path):
    path = make_tiny_model(tmp_path / "sharded", arch="llama", seed=0, max_shard_size="200KB")
    assert not (path / "model.safetensors").exists()
    shards = sorted(p.name for p in path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    unsharded = load_file(model_dirs["llama"] / "model.safetensors")
    assert set(index["weight_map"]) == set(unsharded)
    for shard in shards:
        for name, tensor in load_file(path / shard).items():
            assert index["weight_map"][name] == shard
            assert torch.equal(tensor, unsharded[name]), name
    model = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(model.lm_head.weight, unsharded["lm_head.weight"])


def test_config_overrides_apply(tmp_path):
    path = make_tiny_model(tmp_path / "m", arch="mistral", num_hidden_layers=1, sliding_window=32)
    config = AutoConfig.from_pretrained(path)
    assert (config.num_hidden_layers, config.sliding_window) == (1, 32)
    assert not any(n.startswith("model.layers.1.")
                   for n in load_file(path / "model.safetensors"))


def test_cli_writes_folder_and_lists_files(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["--arch", "qwen2", "--out", str(out), "--seed", "3",
                 "--max-shard-size", "200KB"]) == 0
    printed = capsys.readouterr().out
    assert "model.safetensors.index.json" in printed and "tokenizer.json" in printed
    assert AutoConfig.from_pretrained(out).architectures == ["Qwen2ForCausalLM"]
    assert (out / "model.safetensors.index.json").exists()


def test_unknown_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="arch must be one of"):
        make_tiny_model(tmp_path / "m", arch="gpt2")


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips_unicode_and_prepends_bos(arch, model_dirs, loaded):
    tok = loaded[arch][0]
    from_file = Tokenizer.from_file(str(model_dirs[arch] / "tokenizer.json"))
    vocab_size = AutoConfig.from_pretrained(model_dirs[arch]).vocab_size
    for text in ROUND_TRIP_TEXTS:
        ids = tok.encode(text)
        assert ids == [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
        assert tok.bos_token_id not in ids[1:]
        assert all(0 <= i < vocab_size for i in ids)
        # transformers rebuilds a qwen2 tokenizer's pipeline from its own class; it must agree.
        assert ids == from_file.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids).startswith(BOS_TOKEN)
    decomposed = "e\u0301 n\u0303"  # é ñ as base letter + combining mark
    assert tok.encode(decomposed) == from_file.encode(decomposed).ids
    decoded = tok.decode(tok.encode(decomposed), skip_special_tokens=True)
    expected = unicodedata.normalize("NFC", decomposed) if arch == "qwen2" else decomposed
    assert decoded == expected


def test_vocab_has_merged_and_byte_split_multibyte_characters(loaded):
    tok = loaded["llama"][0]
    merged_utf8_lengths = set()
    for i in range(len(tok)):
        piece = tok.decode([i])
        if "\ufffd" not in piece:
            merged_utf8_lengths |= {len(c.encode()) for c in piece}
    assert {2, 3, 4} <= merged_utf8_lengths  # e.g. "é", "我", " 😀" are single tokens
    crab = tok.encode("🦀", add_special_tokens=False)  # not in the corpus: falls back to bytes
    assert len(crab) >= 2 and tok.decode(crab) == "🦀"


def test_train_tokenizer_alone(tmp_path):
    tok = train_tokenizer(tmp_path, vocab_size=300)
    assert len(tok) == 300
    reloaded = AutoTokenizer.from_pretrained(tmp_path)  # no config.json in the folder
    assert reloaded.encode("naïve 中文") == tok.encode("naïve 中文")
    assert (reloaded.bos_token, reloaded.eos_token, reloaded.pad_token) == (
        "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
    saved_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert saved_config["clean_up_tokenization_spaces"] is False
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(tmp_path / "small", vocab_size=100)


def _greedy(model, ids: torch.Tensor, max_new_tokens: int) -> tuple[int, ...]:
    """Greedy continuation by full recompute (no KV cache): plain and fast at this size."""
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return tuple(ids[0, -max_new_tokens:].tolist())


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_are_well_spread_and_greedy_output_varies(arch, loaded):
    tok, model = loaded[arch]
    text = CORPUS_PATH.read_text(encoding="utf-8")
    ids = tok(text[:3000], return_tensors="pt").input_ids[:, :256]
    with torch.no_grad():
        logits = model(ids).logits[0]                     # [T, V]
    std_per_position = logits.std(dim=-1)
    assert 3.0 < std_per_position.mean().item() < 5.0
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median().item() > 0.4
    assert (gaps < 1e-2).float().mean().item() < 0.03
    predicts_own_input = (logits[:-1].argmax(-1) == ids[0, :-1]).float().mean().item()
    assert predicts_own_input < 0.05

    continuations = [_greedy(model, tok(prompt, return_tensors="pt").input_ids, 16)
                     for prompt in ["The keeper", "Rain begins as vapor", "中文 😀", "1, 2, 3,",
                                    "Hello"]]
    assert len(set(continuations)) == len(continuations)
    assert sum(len(set(c)) >= 6 for c in continuations) >= 4


@pytest.mark.parametrize("first,second", [(None, "200KB"), ("200KB", None)])
def test_a_model_written_again_into_a_used_folder_is_the_new_one(tmp_path, first, second):
    """Sharded after a single file, or the other way round: the first run's weights file (or
    index) stayed beside the new one, and loaders, which take model.safetensors first, got
    the first run's weights."""
    out = tmp_path / "tiny"
    make_tiny_model(out, arch="llama", seed=0, max_shard_size=first)
    make_tiny_model(out, arch="llama", seed=1, max_shard_size=second)
    names = sorted(p.name for p in out.glob("model*"))
    if second is None:
        assert names == ["model.safetensors"]
    else:
        assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    want = make_tiny_model(tmp_path / "fresh", arch="llama", seed=1)
    a = AutoModelForCausalLM.from_pretrained(out)
    b = AutoModelForCausalLM.from_pretrained(want)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
