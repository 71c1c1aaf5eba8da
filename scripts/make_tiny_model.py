"""Write a tiny random-weight Hugging Face model folder for tests, offline and deterministic.

The folder looks like a real transformers-5 checkpoint: config.json, generation_config.json,
model.safetensors (or shards + model.safetensors.index.json) and a byte-level BPE tokenizer
trained on data/tiny_corpus.txt. The same arguments give byte-identical files.

    python scripts/make_tiny_model.py --arch llama --out models/tiny-llama [--seed 0]
        [--max-shard-size 200KB]
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS_PATH = ROOT / "data" / "tiny_corpus.txt"

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
# Pre-tokenizer split patterns of Llama 3 (digits in runs of up to 3) and Qwen2 (single digits),
# as in transformers' TikTokenConverter and models/qwen2/tokenization_qwen2.py.
_LLAMA3_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                       r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                      r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

ARCHS = ("llama", "qwen2", "mistral")

# Shared by all architectures: GQA (4 query heads over 2 KV heads), a few layers, fp32.
_COMMON_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=1024,
    dtype="float32",
)

# Per-architecture features the engine must handle. transformers 5 keeps rope_theta and any
# scaling together in `rope_parameters` (the v4 `rope_theta` / `rope_scaling` keys are folded
# into it on load), so that is what we pass and what lands in config.json.
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        head_dim=32,  # != hidden_size / num_attention_heads (16): q/o projections are not square
        # original_max_position_embeddings=64 puts the llama3 low/high-frequency wavelength
        # bounds (64, 16) inside the range of this model's 16 rotary frequencies, so some are
        # kept, some divided by `factor` and some smoothly interpolated.
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64),
        attention_bias=False,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(  # q/k/v carry a bias by construction in Qwen2
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        tie_word_embeddings=True,
        use_sliding_window=False,
    ),
    "mistral": dict(
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        sliding_window=None,
        tie_word_embeddings=False,
    ),
}

# Weight scales. Linear weights use std 1/sqrt(fan_in) so every projection keeps activations
# at unit scale (attention scores then have std ~1: neither uniform nor one-hot). Embedding
# and LM head use std LOGITS_STD_TARGET/sqrt(hidden_size): the final RMSNorm hands the head a
# unit-RMS vector, so logits come out with std ~LOGITS_STD_TARGET across the vocab. We want
# that a few units: the engine's greedy output is compared token-for-token with HF generate
# in fp32, and with std 4 over 1024 tokens the top-1/top-2 gap is typically ~1 logit (median
# 0.85 measured), so fp32 rounding noise (~1e-5) almost never flips the argmax. Measured on
# 2,000 positions of corpus text (seed 0): logits std across the vocab per position averages
# 3.98 (llama), 3.87 (qwen2), 4.00 (mistral), range 3.5-4.4; 0.65-1% of positions have a
# top-1/top-2 gap under 1e-2, the smallest gap seen is 5e-5.
LOGITS_STD_TARGET = 4.0
NORM_WEIGHT_NOISE_STD = 0.1   # norm weights 1 + noise, so a missed norm weight shows up
BIAS_STD = 0.1
# With tied embeddings the input token's embedding e_t stays in the residual stream x and the
# head adds |e_t|^2 / rms(x) to that token's own logit: at gain 1, 40% of positions predicted
# their own input and greedy decoding repeated one token forever. Scaling
# the residual branches' output projections (o_proj, down_proj) makes e_t a small part of x;
# at 16, 0.3% of positions predict their own input and greedy outputs vary about as much as
# untied models' do at gain 1 (gain 2-4 still left most prompts looping on 2-3 tokens).
TIED_RESIDUAL_GAIN = 16.0


def train_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 1024, arch: str = "llama"):
    """Train a byte-level BPE tokenizer on the shipped corpus and save it into `out_dir`.

    Llama-3 style: regex split + byte-level pre-tokenizer and a byte-level decoder, so any
    UTF-8 text round-trips, and BOS is prepended on encode. For `arch="qwen2"` the split regex
    and NFC normalizer are Qwen2's: transformers 5 loads a qwen2 folder with `Qwen2Tokenizer`,
    which keeps only vocab, merges and post-processor from tokenizer.json and rebuilds the rest
    its own way, so the file must already hold what it rebuilds. Returns the saved tokenizer.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers
    from transformers import PreTrainedTokenizerFast

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {list(ARCHS)}, got {arch!r}")
    special_tokens = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size must be >= {256 + len(special_tokens)} (bytes + special "
                         f"tokens), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    if arch == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    split_regex = _QWEN2_SPLIT_REGEX if arch == "qwen2" else _LLAMA3_SPLIT_REGEX
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    # The full 256-byte alphabet is seeded in sorted order, so token ids never depend on the
    # order words are seen; merges break count ties by pair id. The result does not depend on
    # the thread count (same tokenizer.json with RAYON_NUM_THREADS=1, 2, 16).
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train([str(CORPUS_PATH)], trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS_TOKEN} $A",
                                      pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                                      special_tokens=[(BOS_TOKEN, bos_id)]),
    ])
    # unk_token=None is saved as null; without it Qwen2Tokenizer adds "<|endoftext|>" as an
    # extra token past the end of the vocabulary. clean_up_tokenization_spaces would turn
    # " ." into "." on decode; transformers 5 ignores it for BPE, other readers may not.
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS_TOKEN,
                                   eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=None,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out_dir))
    return fast


def build_config(arch: str, tokenizer, **config_overrides):
    """The transformers config for `arch`, sized to the tokenizer, with overrides applied."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    config_classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    if arch not in config_classes:
        raise ValueError(f"arch must be one of {list(ARCHS)}, got {arch!r}")
    config_dict: dict[str, Any] = {**_COMMON_CONFIG, **ARCH_CONFIGS[arch]}
    config_dict["rope_parameters"] = dict(config_dict["rope_parameters"])  # configs mutate it
    config_dict.update(
        vocab_size=len(tokenizer),  # every id the tokenizer can produce is a valid row
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config_dict.update(config_overrides)
    return config_classes[arch](**config_dict)


def init_weights_(model, seed: int) -> None:
    """Overwrite every parameter with seeded normal noise at the scales described above."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden_size = model.config.hidden_size
    embed_std = LOGITS_STD_TARGET / math.sqrt(hidden_size)
    residual_gain = TIED_RESIDUAL_GAIN if model.config.tie_word_embeddings else 1.0
    with torch.no_grad():
        # named_parameters() is in module-definition order and yields a tied weight once.
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + NORM_WEIGHT_NOISE_STD * noise)
            elif name.endswith(".bias"):
                param.copy_(BIAS_STD * noise)
            elif "embed_tokens" in name or name.startswith("lm_head"):
                param.copy_(embed_std * noise)
            else:
                assert param.dim() == 2, name
                writes_residual = name.endswith(("o_proj.weight", "down_proj.weight"))
                gain = residual_gain if writes_residual else 1.0
                param.copy_(gain * noise / math.sqrt(param.shape[1]))  # [out, in]: 1/sqrt(fan_in)


def make_tiny_model(out_dir: str | os.PathLike, arch: str = "llama", seed: int = 0,
                    max_shard_size: int | str | None = None,
                    **config_overrides) -> pathlib.Path:
    """Write tokenizer, config, generation config and seeded random weights into `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {list(ARCHS)}, got {arch!r}")
    out_path = pathlib.Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out_path, arch=arch)
    config = build_config(arch, tokenizer, **config_overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights_(model, seed)
    # Greedy by default: tests compare greedy output with the engine's.
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    # transformers 5 always writes safetensors (no safe_serialization argument any more).
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    # A folder used before: its weights go first (a single file left beside new shards, or an
    # index beside a new single file, is what loaders would take).
    for stale in [*out_path.glob("model*.safetensors"), out_path / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    model.save_pretrained(str(out_path), **save_kwargs)
    return out_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--out", required=True, help="output folder (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default=None,
                        help='e.g. "200KB" to write sharded safetensors and an index')
    args = parser.parse_args(argv)

    out_path = make_tiny_model(args.out, arch=args.arch, seed=args.seed,
                               max_shard_size=args.max_shard_size)
    print(f"wrote tiny {args.arch} model (seed {args.seed}) to {out_path}")
    total_bytes = 0
    for path in sorted(out_path.iterdir()):
        size_bytes = path.stat().st_size
        total_bytes += size_bytes
        print(f"  {path.name:<36} {size_bytes:>10,} bytes")
    print(f"  {'total':<36} {total_bytes:>10,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
