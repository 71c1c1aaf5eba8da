"""Build a model straight in its target dtype and device, then fill it from a HF checkpoint.

The module is created on the meta device, cast (free: meta tensors have no storage) and only
then allocated on the target device, so a bf16 model never exists in fp32. Checkpoint tensors
are read one at a time from the safetensors files and copied into their slice of our fused
parameters, so no second copy of the model is ever held.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

import torch
from safetensors import safe_open

from engine.models.attention import TORCH_REF_BACKEND, AttentionBackend
from engine.models.config import ModelConfig
from engine.models.fp8_linear import quantize_model
from engine.models.llama import LlamaForCausalLM, RMSNorm

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_DUMMY_INIT_RANGE = 1e-3
# Fused parameter -> the HF projections stacked in it, in row order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def load_model(
    model_path: str | os.PathLike,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    attention_backend: AttentionBackend = TORCH_REF_BACKEND,
    fused_kernels: bool = False,
    fuse_rope_kv_write: bool = True,
    quantization: str | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load a Llama / Mistral / Qwen2 checkpoint folder as an inference-only model.

    load_format: "auto" / "safetensors" read `model.safetensors` or the shards listed in
    `model.safetensors.index.json`; "dummy" needs only config.json and fills small random
    weights from torch's current seed (for benchmarks at real sizes).
    quantization: None, or "fp8" (EngineConfig.quantization): the decoder layers' projections are
    quantized once loaded (engine/models/fp8_linear.py).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}")
    config = ModelConfig.from_pretrained(model_path)
    # A tied config's checkpoint may store the shared matrix under either name, or both.
    stored = (_checkpoint_files_by_name(os.fspath(model_path))
              if config.tie_word_embeddings and load_format != "dummy" else None)
    if stored is not None:
        config = _untie_if_the_checkpoint_does(config, stored, os.fspath(model_path))
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention_backend, fused_kernels, fuse_rope_kv_write)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.requires_grad_(False)
    model.eval()
    with torch.no_grad():
        if load_format == "dummy":
            _init_dummy(model)
        else:
            _load_safetensors(model, os.fspath(model_path), stored)
        if quantization == "fp8":
            quantize_model(model)
            if device.type == "cuda":
                torch.cuda.empty_cache()    # the model-dtype weights' memory, before the KV cache is sized
    logger.info("loaded %s from %s (%s, %s, load_format=%s, quantization=%s)", config.architecture, model_path,
                dtype, device, load_format, quantization)
    return model, config


def _init_dummy(model: LlamaForCausalLM) -> None:
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for param in model.parameters():
        if id(param) in norm_weights:
            param.fill_(1.0)
        else:
            param.uniform_(-_DUMMY_INIT_RANGE, _DUMMY_INIT_RANGE)


def _checkpoint_layout(model: LlamaForCausalLM) -> dict[str, tuple[str, torch.Tensor]]:
    """HF tensor name -> (our parameter name, the slice of it that tensor fills)."""
    config = model.config
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows,
            "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    layout = {}
    for name, param in model.named_parameters():
        prefix = "" if name.startswith("lm_head.") else "model."
        module_path, leaf = name.rsplit(".", 1)
        parent, module_name = module_path.rsplit(".", 1) if "." in module_path else ("", module_path)
        if module_name not in _FUSED:
            layout[prefix + name] = (name, param)
            continue
        start = 0
        for part in _FUSED[module_name]:
            layout[f"{prefix}{parent}.{part}.{leaf}"] = (name, param.narrow(0, start, rows[part]))
            start += rows[part]
        assert start == param.shape[0], f"{name}: fused rows {start} != {param.shape[0]}"
    return layout


def _is_ignored(checkpoint_name: str, config: ModelConfig) -> bool:
    # Rotary tables are recomputed; a tied model may still ship its (identical) lm_head copy.
    return checkpoint_name.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and checkpoint_name == "lm_head.weight"
    )


def _checkpoint_files_by_name(folder: str) -> dict[str, str]:
    """Tensor name -> the file holding it (reads the files' headers only)."""
    names = {}
    for file in _safetensors_files(folder):
        with safe_open(file, framework="pt", device="cpu") as f:
            names.update((name, file) for name in f.keys())
    return names


def _untie_if_the_checkpoint_does(config: ModelConfig, files: dict[str, str],
                                  folder: str) -> ModelConfig:
    """A config that ties the embeddings may still ship an lm_head of its own. transformers
    keeps it where it differs from embed_tokens (it warns and does not tie), so we do too.
    files: _checkpoint_files_by_name(folder)."""
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if head not in files or embed not in files:
        return config                   # one copy (the other is filled from it) or none
    with safe_open(files[head], framework="pt", device="cpu") as f:
        head_weight = f.get_tensor(head)
    with safe_open(files[embed], framework="pt", device="cpu") as f:
        embed_weight = f.get_tensor(embed)
    if head_weight.shape == embed_weight.shape and torch.equal(head_weight, embed_weight):
        return config
    logger.warning("config.json ties the embeddings, but %s holds an lm_head.weight that differs "
                   "from embed_tokens: it is used untied, as transformers does", folder)
    return dataclasses.replace(config, tie_word_embeddings=False)


def _safetensors_files(folder: str) -> list[str]:
    """The checkpoint's weight files, chosen as transformers chooses them: model.safetensors
    before an index of shards (a folder may hold both, one of them stale)."""
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index_file = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file, encoding="utf-8") as f:
            shard_names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, name) for name in shard_names]
        for file in files:
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{index_file} lists {os.path.basename(file)}, which is not in {folder!r}")
        return files
    files = sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no safetensors weights (model.safetensors or model.safetensors.index.json) in {folder!r}; "
            f"use load_format='dummy' for random weights"
        )
    return files


def _load_safetensors(model: LlamaForCausalLM, folder: str,
                      stored: dict[str, str] | None = None) -> None:
    """stored: the checkpoint's tensor names (_checkpoint_files_by_name) where the model is tied."""
    layout = _checkpoint_layout(model)
    if (model.config.tie_word_embeddings and stored is not None
            and "model.embed_tokens.weight" not in stored and "lm_head.weight" in stored):
        # The one shared matrix stored as lm_head only (transformers reads it so too).
        layout["lm_head.weight"] = layout.pop("model.embed_tokens.weight")
    remaining = set(layout)
    for file in _safetensors_files(folder):
        with safe_open(file, framework="pt", device="cpu") as f:
            for checkpoint_name in f.keys():
                if checkpoint_name not in layout:
                    if _is_ignored(checkpoint_name, model.config):
                        continue
                    raise ValueError(
                        f"unexpected weight {checkpoint_name!r} in {os.path.basename(file)}: "
                        f"the checkpoint does not match {model.config.architecture} as configured"
                    )
                our_name, target = layout[checkpoint_name]
                tensor = f.get_tensor(checkpoint_name)
                if tensor.shape != target.shape:
                    raise ValueError(
                        f"weight {checkpoint_name!r} in {os.path.basename(file)} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(target.shape)} (for {our_name})"
                    )
                target.copy_(tensor)  # casts to the model dtype and moves to its device
                remaining.discard(checkpoint_name)
    if remaining:
        missing = sorted(remaining)
        raise ValueError(
            f"checkpoint in {folder!r} lacks {len(missing)} expected weight(s): {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
