"""What the engine needs to know about a checkpoint, read from its config.json.

Both transformers-4 keys (`rope_theta` + `rope_scaling`) and transformers-5 keys (one
`rope_parameters` dict holding `rope_theta`) are accepted and normalized the same way.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# A config.json without `architectures` names its class by `model_type`, as transformers reads it.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# What transformers' config class of each architecture takes for a key the file leaves out (an
# explicit null is kept: Mistral 7B v0.2 says "sliding_window": null for no window).
_ABSENT_KEY_DEFAULTS = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "sliding_window": None},
    "MistralForCausalLM": {"max_position_embeddings": 131072, "sliding_window": 4096,
                           "num_key_value_heads": 8},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "sliding_window": 4096},
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else {"rope_type": "linear", "factor"} or {"rope_type": "llama3",
    # "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    # Layer indices that use `sliding_window`: all of them for Mistral, those at or past
    # `max_window_layers` (or marked "sliding_attention" in `layer_types`) for Qwen2.
    sliding_window_layers: tuple[int, ...]
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None

    @property
    def max_context_len(self) -> int:
        """The longest context the model takes (the default and the limit of `max_model_len`):
        `max_position_embeddings`, times the factor under linear RoPE scaling, as vLLM derives
        it (a llama3-scaled model's `max_position_embeddings` already counts its factor)."""
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "linear":
            return int(self.max_position_embeddings * self.rope_scaling["factor"])
        return self.max_position_embeddings

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The attention window of one layer, or None for full causal attention."""
        return self.sliding_window if layer_idx in self.sliding_window_layers else None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read `path/config.json` (and `path/generation_config.json` for extra eos ids)."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"model path {path!r} is not a folder (expected a local HF checkpoint folder)")
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise ValueError(f"no config.json in model folder {path!r}")
        with open(config_file, encoding="utf-8") as f:
            raw = json.load(f)
        generation = None
        generation_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(generation_file):
            with open(generation_file, encoding="utf-8") as f:
                generation = json.load(f)
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        """Build from the parsed config.json (and generation_config.json) dicts."""
        architectures = raw.get("architectures") or []
        if architectures:
            architecture = architectures[0]
            if architecture not in SUPPORTED_ARCHITECTURES:
                raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                                 f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        else:
            model_type = raw.get("model_type")
            if model_type not in _MODEL_TYPES:
                raise ValueError(
                    f"config.json names no supported architecture: `architectures` is absent and "
                    f"`model_type` is {model_type!r}; supported model_type values: "
                    f"{', '.join(_MODEL_TYPES)}")
            architecture = _MODEL_TYPES[model_type]
        defaults = _ABSENT_KEY_DEFAULTS[architecture]
        raw = {**{k: v for k, v in defaults.items() if k not in raw}, **raw}
        missing = [key for key in _REQUIRED_KEYS if raw.get(key) is None]
        if missing:
            raise ValueError(f"config.json lacks required key(s): {', '.join(missing)}")
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):      # transformers' two names of one function
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: 'silu' "
                             f"(also named 'swish')")

        num_heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
        num_layers = raw["num_hidden_layers"]
        max_position_embeddings = raw["max_position_embeddings"] or defaults["max_position_embeddings"]
        rope_theta, rope_scaling = _parse_rope(raw, max_position_embeddings)

        is_qwen2 = architecture == "Qwen2ForCausalLM"
        # transformers' Qwen2 has biases on q, k and v only, and its Mistral none, whatever
        # the flags say; its Llama takes them from the flags.
        fixed_bias = architecture != "LlamaForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        sliding_window, sliding_window_layers = _parse_sliding_window(raw, architecture,
                                                                      num_layers)
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 if fixed_bias else attention_bias,
            o_bias=False if fixed_bias else attention_bias,
            mlp_bias=False if fixed_bias else bool(raw.get("mlp_bias", False)),
            sliding_window=sliding_window,
            sliding_window_layers=sliding_window_layers,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw, generation_config),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),   # transformers' order
        )


def _parse_rope(raw: dict[str, Any], max_position_embeddings: int) -> tuple[float, dict[str, Any] | None]:
    # transformers gives `rope_scaling` priority over `rope_parameters`, and a theta inside the
    # dict priority over a top-level `rope_theta`.
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    rope_theta = float(params.get("rope_theta") or raw.get("rope_theta") or _DEFAULT_ROPE_THETA)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return rope_theta, None
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):   # HF's scaled ropes take it and then fail on the shapes
        raise ValueError(f"partial_rotary_factor {partial!r} is not supported with rope type "
                         f"{rope_type!r}: only 1 (every dimension rotated)")

    def positive(key: str) -> float:
        if key not in params:
            raise ValueError(f"rope type {rope_type!r} needs the parameter {key!r}")
        value = params[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"rope type {rope_type!r}: {key!r} must be a number > 0, "
                             f"got {value!r}")
        return float(value)

    if rope_type == "linear":
        return rope_theta, {"rope_type": "linear", "factor": positive("factor")}
    scaling = {"rope_type": "llama3", "factor": positive("factor"),
               "low_freq_factor": positive("low_freq_factor"),
               "high_freq_factor": positive("high_freq_factor"),
               "original_max_position_embeddings": int(
                   params.get("original_max_position_embeddings") or max_position_embeddings)}
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(f"rope type 'llama3': 'high_freq_factor' must be greater than "
                         f"'low_freq_factor', got {scaling['high_freq_factor']!r} and "
                         f"{scaling['low_freq_factor']!r}")
    return rope_theta, scaling


def _parse_sliding_window(raw: dict[str, Any], architecture: str,
                          num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """The window and the layers it applies to. Llama has no sliding window: transformers'
    and vLLM's Llama read no `sliding_window` key, which a "llamafied" Mistral or Qwen2
    checkpoint may still carry."""
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    window = raw.get("sliding_window")
    if architecture == "LlamaForCausalLM" or (is_qwen2 and not raw.get("use_sliding_window", False)):
        window = None
    if window is None:
        return None, ()
    if not is_qwen2:
        return window, tuple(range(num_layers))
    layer_types = raw.get("layer_types")
    if layer_types:
        return window, tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    max_window_layers = raw.get("max_window_layers", 28)
    return window, tuple(range(max_window_layers, num_layers))


def _eos_ids(raw: dict[str, Any], generation_config: dict[str, Any] | None) -> list[int]:
    """The ids that end a generation: generation_config.json's where it names them, else
    config.json's (the two files may differ). Where a generation_config.json names none,
    transformers' generate stops on no EOS at all (it takes that file as it is), but vLLM
    still stops on the tokenizer's EOS; so does this, on config.json's."""
    value = (generation_config or {}).get("eos_token_id")
    if value is None:
        value = raw.get("eos_token_id")
    ids: list[int] = []
    for token_id in [value] if isinstance(value, int) else value or []:
        if token_id not in ids:
            ids.append(token_id)
    return ids
