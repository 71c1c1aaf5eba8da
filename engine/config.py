"""Engine settings (vLLM names). Every value is checked at construction."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields
from typing import Any

DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
TOKENIZER_PRIORITIES = ("idle", "low", "normal")
SKINNY_GEMM = ("auto", "off")
CAPACITY_POLICIES = ("max_utilization", "guaranteed_no_evict")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS = ("fp8",)


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None          # defaults to `model`
    dtype: str = "auto"                   # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"                  # auto: cuda if available, else cpu; or "cpu", "cuda", "cuda:N"
    max_model_len: int | None = None      # None: the model's context length (ModelConfig.max_context_len)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # max_utilization: admit while the blocks for what is computed now last, preempt when the
    # pool runs out (vLLM); guaranteed_no_evict: admit only with room for every running request
    # to reach its max_tokens, never preempt (TensorRT-LLM's names; engine/scheduler.py).
    capacity_scheduler_policy: str = "max_utilization"
    # A step of decode rows alone may keep new prompts waiting up to this many steps (while
    # their tokens would not fill the step), so prompts that arrive one by one share fewer,
    # fuller steps outside the decode CUDA graph (engine/scheduler.py). 0: admit at once (vLLM).
    prefill_hold_steps: int = 0
    block_size: int = 16
    # auto: the KV cache holds the model's dtype; fp8 (= fp8_e4m3): one byte a value, so twice the
    # tokens fit and decode attention reads half the bytes. Keys and values are stored clamped to
    # +-448 and rounded (no scale: vLLM's fp8 cache without calibrated scales), and widened to the
    # model's dtype as the attention reads them (kernels/attention_ref.py). Greedy output can
    # differ from the model's own. GPUs of compute capability 8.9 and up, and CPU.
    kv_cache_dtype: str = "auto"
    # None: the projections run in the model's dtype. fp8: each decoder layer's four projections
    # hold FP8 e4m3 weights with a scale per output channel, made at load time from the
    # checkpoint, and quantize their inputs per token as they run (vLLM's dynamic FP8; W8A8,
    # engine/models/fp8_linear.py): half the weight bytes, FP8 tensor cores. The embeddings and
    # lm_head keep the model's dtype. Greedy output can differ from the model's own. GPUs of
    # compute capability 9.0 and up (torch._scaled_mm's row-wise scales), and CPU.
    quantization: str | None = None
    num_kv_blocks: int | None = None      # None: sized from memory
    # The share of the GPU's memory this engine may use (weights, activations, KV cache),
    # others' use not counted: vLLM V1's rule (engine/model_runner.kv_cache_blocks).
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 2.0          # KV budget on CPU when num_kv_blocks is None
    # torch intra-op threads (on CPU the model's, on a GPU the host's staging copies). None: in
    # the engine core process (AsyncEngine, the server) half the CPUs on CPU, one with a GPU
    # (engine/core_process.default_cpu_threads says why); LLM, in the caller's process, leaves
    # torch's global setting alone.
    cpu_threads: int | None = None
    enable_prefix_caching: bool = True
    # LLM.generate finds prompts sharing a prefix of whole KV blocks, computes each prefix once
    # and keeps it resident while its group runs (engine/prefix_groups.py, the scheduler).
    enable_prefix_groups: bool = True
    # Rows whose KV blocks start alike read their shared prefix once per step (cascade
    # attention), where the cost rule says it pays (engine/cascade_plan.py).
    enable_cascade_attention: bool = True
    load_format: str = "auto"
    seed: int = 0
    skip_tokenizer_init: bool = False     # token ids in and out only (benchmarks, no text)
    enforce_eager: bool = False           # no CUDA graphs / padded decode path
    # Steps holding prompt chunks of up to this many tokens (in all) replay CUDA graphs cut at
    # attention (engine/piecewise_graphs.py), larger ones launch eagerly; 0: every such step
    # eagerly. Capped at max_num_batched_tokens. CUDA only.
    piecewise_graph_max_tokens: int = 2048
    # GPU: rotary embedding and the KV-cache write as one kernel (kernels/rotary_write_kv.py);
    # false: the two kernels (kernels/rotary.py, kernels/kv_cache.py). Same numbers either way.
    fuse_rope_kv_write: bool = True
    # GPU decode graphs: split-KV attention merges its splits in the same kernel (the last
    # program of a head merges; kernels/paged_attention.py), so small batches take many splits
    # even at short contexts (choose_fused_kv_splits); false: the separate merge kernel and its
    # split rule (one split under 512 keys). Same numbers to fp32 rounding.
    fuse_kv_split_merge: bool = True
    # GPU, projections of up to 16 rows (decode): "auto" times cuBLAS against the Triton skinny
    # GEMM (kernels/skinny_gemm.py) per shape and row count at start-up and runs the faster
    # (engine/gemm_tuning.py); "off": cuBLAS only.
    skinny_gemm: str = "auto"
    # GPU (compute capability 9.0 and up), decode CUDA graphs of up to 16 rows: the Triton
    # kernels launch with programmatic dependent launch, each placed while the one ahead still
    # runs, and every projection runs as the skinny GEMM (cuBLAS takes no part in PDL;
    # kernels/pdl.py). The skinny GEMM's own rounding. H200, Llama-3.1-8B, one stream:
    # 4.72 -> 4.51 ms/token (benchmarks/h200/decode_pdl.md).
    decode_pdl: bool = True
    # Where qkv_proj, o_proj and down_proj run the skinny GEMM (decode, up to 16 rows), the kernel
    # after them (rotary + KV write, RMSNorm) merges their split-K partials as it reads them,
    # instead of the GEMM's last program (engine/models/linear.py, SplitSums). The same bits.
    # H100, Llama-3.1-8B, one stream: 6.05 -> 5.90 ms/token (benchmarks/h100/decode_experiments.md).
    decode_late_merge: bool = True
    # Plan and launch step N+1 while the GPU runs step N (engine/engine_core.py); its tokens
    # come back one step later. False: each step waits for its tokens before the next is planned.
    async_scheduling: bool = True
    # Prompts up to this many characters are tokenized on the event loop, not queued for the
    # tokenizer thread (where they could wait behind a long prompt); 0: never. Measured on the
    # bundled tokenizer (2.5 GHz Xeon): 256 characters take 0.18 ms, 1024 take 0.7 ms.
    tokenize_inline_max_chars: int = 256
    # Longer prompts are tokenized in a process of their own, at a lower CPU priority, so a
    # flood of huge prompts takes CPU time only when the serving loop and the engine core leave
    # some; false: on the tokenizer thread of the serving process. Priority (see
    # TOKENIZER_PRIORITIES): idle = Linux SCHED_IDLE, the CPU time nothing else wants (still a
    # small share under full load); low = niceness 10; normal = the server's.
    tokenizer_process: bool = True
    tokenizer_process_priority: str = "idle"
    # Served (engine/serving.py): threads that send responses. A send is a round trip to the
    # server; while every sender is busy, a stream's new tokens wait and leave together in its
    # next response (engine/outbox.py). One measured best on the H200 at 256 streams (Triton's
    # queue in front of execute 10 ms against 25-69 with 4, the stub at 0.6 of a core against
    # 1.0, TTFT lower, throughput the same: benchmarks/h200/serving_senders.md).
    response_senders: int = 1
    # Served: sys.setswitchinterval of the serving process, in microseconds. A thread that
    # wants the GIL (Triton's call of `execute`, a sender back from its round trip) waits up to
    # this long for the thread holding it; Python's default is 5000.
    gil_switch_interval_us: int = 500
    # Served with several instances (one per GPU): a request whose prompt shares at least 4 KV
    # blocks of prefix with what other instances' engines took runs on the least loaded of
    # them (this one's if it holds the prefix too and is no busier), unless only others hold
    # it and have max_num_seqs / 2 (prefix_routing_slack) more requests than this one's
    # (engine/prefix_routing.py). Needs prefix caching.
    prefix_routing: bool = True
    # Prefix routing: how many requests more than this instance's engine another engine may
    # have and still take a prefix that only it holds (a group kept whole on one GPU against
    # the GPUs' loads kept even). None: max_num_seqs / 2, at least 1.
    prefix_routing_slack: int | None = None

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer"):         # a pathlib.Path as the path it names
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        self.validate()

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineConfig":
        """Build from user settings (e.g. config.pbtxt parameters); unknown keys are errors."""
        unknown = sorted(set(d) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown engine setting(s) {unknown}; valid settings are "
                             f"{cls.field_names()}")
        return cls(**d)

    @classmethod
    def from_strings(cls, d: dict[str, str]) -> "EngineConfig":
        """Build from string values (Triton `parameters`), converted by each field's type."""
        types = {f.name: str(f.type) for f in fields(cls)}
        unknown = sorted(set(d) - set(types))
        if unknown:
            raise ValueError(f"unknown engine setting(s) {unknown}; valid settings are "
                             f"{list(types)}")
        values: dict[str, Any] = {}
        for k, v in d.items():
            t = types[k]
            s = v.strip()
            if s == "" or (s.lower() == "none" and "None" in t):
                continue                    # keep the default
            try:
                if t.startswith("bool"):
                    if s.lower() not in ("true", "false", "1", "0"):
                        raise ValueError
                    values[k] = s.lower() in ("true", "1")
                elif t.startswith("int"):
                    if "_" in s:                # int() takes "1_0" as 10
                        raise ValueError
                    values[k] = int(s)
                elif t.startswith("float"):
                    if "_" in s:
                        raise ValueError
                    values[k] = float(s)
                else:
                    values[k] = s
            except ValueError:
                kind = t.split(" ")[0]
                allowed = " (true, false, 1 or 0)" if kind == "bool" else ""
                raise ValueError(f"{k} must be of type {kind}{allowed}, got {v!r}") from None
        return cls(**values)

    def validate(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a path to a local Hugging Face model folder")
        if not os.path.isdir(self.model):
            raise ValueError(f"model: folder {self.model!r} does not exist")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ValueError(f"tokenizer must be a path to a local folder, got {self.tokenizer!r}")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise ValueError(f"tokenizer: folder {self.tokenizer!r} does not exist")
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None (the model's dtype) or one of "
                             f"{list(QUANTIZATIONS)}, got {self.quantization!r}")
        if not isinstance(self.device, str) or not (
                self.device in ("auto", "cpu", "cuda") or _is_cuda_index(self.device)):
            raise ValueError(f"device must be one of 'auto', 'cpu', 'cuda', 'cuda:N', "
                             f"got {self.device!r}")
        if self.max_model_len is not None:
            _int_at_least("max_model_len", self.max_model_len, 1)
        _int_at_least("max_num_seqs", self.max_num_seqs, 1)
        _int_at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _int_at_least("prefill_hold_steps", self.prefill_hold_steps, 0)
        _int_at_least("piecewise_graph_max_tokens", self.piecewise_graph_max_tokens, 0)
        _int_at_least("block_size", self.block_size, 1)
        if self.num_kv_blocks is not None:
            _int_at_least("num_kv_blocks", self.num_kv_blocks, 1)
        _float_in("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0)
        _float_in("cpu_kv_cache_gb", self.cpu_kv_cache_gb, 0.0, 1e6)
        if self.cpu_threads is not None:
            _int_at_least("cpu_threads", self.cpu_threads, 1)
        for name in ("enable_prefix_caching", "enable_prefix_groups", "enable_cascade_attention",
                     "async_scheduling", "fuse_rope_kv_write", "fuse_kv_split_merge", "decode_pdl",
                     "decode_late_merge", "prefix_routing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.prefix_routing_slack is not None:
            _int_at_least("prefix_routing_slack", self.prefix_routing_slack, 0)
        _one_of("load_format", self.load_format, LOAD_FORMATS)
        _one_of("skinny_gemm", self.skinny_gemm, SKINNY_GEMM)
        _one_of("capacity_scheduler_policy", self.capacity_scheduler_policy, CAPACITY_POLICIES)
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if not isinstance(self.skip_tokenizer_init, bool):
            raise ValueError(f"skip_tokenizer_init must be true or false, "
                             f"got {self.skip_tokenizer_init!r}")
        _int_at_least("tokenize_inline_max_chars", self.tokenize_inline_max_chars, 0)
        if not isinstance(self.tokenizer_process, bool):
            raise ValueError(f"tokenizer_process must be true or false, "
                             f"got {self.tokenizer_process!r}")
        _int_at_least("response_senders", self.response_senders, 1)
        _int_at_least("gil_switch_interval_us", self.gil_switch_interval_us, 1)
        _one_of("tokenizer_process_priority", self.tokenizer_process_priority,
                TOKENIZER_PRIORITIES)
        if (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                or not -2**63 <= self.seed < 2**64):           # what torch.manual_seed takes
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")


def _is_cuda_index(s: str) -> bool:
    return s.startswith("cuda:") and s[5:].isdigit()


def _one_of(name: str, v: Any, allowed: tuple[str, ...]) -> None:
    if v not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {v!r}")


def _int_at_least(name: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


def _float_in(name: str, v: Any, lo: float, hi: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v <= hi):
        raise ValueError(f"{name} must be a number in ({lo}, {hi}], got {v!r}")


# Parameters of Triton's Python backend itself (a conda-pack environment, ...): not the engine's.
PYTHON_BACKEND_PARAMETERS = ("EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS")


def instance_device(kind: str, device_id: int | str) -> str:
    """The engine's device for a Triton model instance: KIND_GPU its GPU, KIND_CPU the CPU, and
    KIND_MODEL (Triton's vLLM backend's sample config: the model places itself) "auto", a GPU
    where there is one. A `device` parameter in the config overrides it."""
    return {"GPU": f"cuda:{device_id}", "CPU": "cpu"}.get(kind, "auto")


def engine_device(device: str) -> str:
    """The device an engine set to `device` runs on, named as the engine core resolves it
    ("auto": the first GPU where there is one; "cuda": the first GPU), for labels and logs.
    Counts GPUs without starting CUDA here (torch asks NVML where it can)."""
    if device in ("auto", "cuda"):
        import torch
        return "cuda:0" if device == "cuda" or torch.cuda.device_count() > 0 else "cpu"
    return device


def refuse_triton_batching(model_config: dict) -> None:
    """The models take requests one by one, their inputs without a batch dimension (the engine
    batches them itself): a Triton config with `max_batch_size` above 0 loaded and then failed
    every request on its inputs' shapes. Refused at load, naming the setting."""
    size = model_config.get("max_batch_size", 0)
    if size:
        raise ValueError(f"max_batch_size must be 0 for the {model_config.get('name', 'llm')} "
                         f"model, got {size}: it takes requests one by one (the engine batches "
                         f"them itself) and its inputs have no batch dimension")


def settings_from_triton(model_config: dict, repository: str, device: str) -> dict[str, str]:
    """Engine settings from a Triton model config's `parameters` (string values; an empty one
    keeps the default). `model` and `tokenizer` paths are resolved against the model
    repository (`tokenizer` "none": the model's); `device` comes from the instance (KIND_CPU /
    KIND_GPU with its device id) unless a parameter sets it."""
    params = {k: v.get("string_value", "").strip()
              for k, v in model_config.get("parameters", {}).items()
              if k not in PYTHON_BACKEND_PARAMETERS}
    params = {k: v for k, v in params.items() if v}
    if "model" not in params:
        raise ValueError("the model's config.pbtxt needs a `model` parameter: the local Hugging "
                         "Face folder to serve (relative to the model repository or absolute)")
    for key in ("model", "tokenizer"):
        if key in params and params[key].lower() != "none":
            # Against the repository's real path, as the OS would resolve "<repository>/../x"
            # (a repository reached through a link: scripts/tritonserver_env.space_free).
            path = os.path.expanduser(params[key])
            params[key] = os.path.normpath(path if os.path.isabs(path) else
                                           os.path.join(os.path.realpath(repository), path))
    params.setdefault("device", device)
    return params



def model_key(config: EngineConfig) -> str:
    """What makes two engines give the same answers: the model folder (its config.json and its
    checkpoint files' names, sizes and modification times), the dtypes and quantization, and
    for random weights the seed. Engines with other keys must not take each other's requests
    (prefix routing: engine/prefix_routing.py); a folder whose files are rewritten in place
    gets a new key."""
    parts = {name: getattr(config, name)
             for name in ("dtype", "kv_cache_dtype", "quantization", "load_format")}
    if config.load_format == "dummy":
        parts["seed"] = config.seed
    folder = os.path.realpath(config.model)
    parts["model"] = folder
    files = []
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name == "config.json" or name.endswith((".safetensors", ".safetensors.index.json")):
                st = os.stat(os.path.join(folder, name))
                files.append((name, st.st_size, st.st_mtime_ns))
    parts["files"] = files
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
