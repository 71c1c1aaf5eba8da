"""Shared by the benchmarks: model presets (real configs, dummy weights), hardware, results."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from engine.config import KV_CACHE_DTYPES, QUANTIZATIONS  # noqa: E402 - the root is on the path now

# Llama-3.1-8B's config.json (the architecture; weights are random, `load_format="dummy"`).
PRESETS = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
}

# H200 SXM datasheet peaks; what a benchmark is compared against.
HBM_BYTES_PER_S = 4.8e12
BF16_DENSE_FLOPS = 989.4e12
FP8_DENSE_FLOPS = 1978.9e12     # H200 datasheet, dense FP8 tensor cores


def positive_ints(text: str, what: str, fields: str, example: str, sep: str = ",") -> tuple[int, ...]:
    """An argparse type's work: `text` as len(fields) positive ints, e.g. '128,64,8,3' -> (128,
    64, 8, 3); else an ArgumentTypeError naming the fields and an example."""
    parts = text.split(sep)
    if len(parts) != len(fields.split(sep)) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{what} is {fields}, e.g. {example}, got {text!r}")
    return tuple(int(p) for p in parts)


def preset_dir(name: str, tokenizer: bool = False) -> str:
    """A model folder holding the preset's config.json (for dummy weights) and, with
    `tokenizer`, a tokenizer covering the preset's whole vocabulary (`bench_tokenizer`)."""
    d = os.path.join(tempfile.gettempdir(), f"preset-{name}" + ("-tok" if tokenizer else ""))
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        # transformers_version: without it transformers 5 takes a local folder for an old
        # Mistral one and warns that its tokenizer's regex may be wrong.
        json.dump({**PRESETS[name], "transformers_version": "5.0.0"}, f)
    if tokenizer and not os.path.exists(os.path.join(d, "tokenizer.json")):
        bench_tokenizer(d, PRESETS[name]["vocab_size"])
    return d


def add_scheduling_arg(ap) -> None:
    """The step benches' `--sync-scheduling` (EngineConfig.async_scheduling off)."""
    ap.add_argument("--sync-scheduling", action="store_true",
                    help="each step waits for its tokens before the next is planned")


def add_pdl_arg(ap) -> None:
    """The step benches' `--decode-pdl true|false` and `--decode-late-merge true|false`
    (EngineConfig.decode_pdl, decode_late_merge; unset: the engine's default); `pdl_setting(args)`
    gives the engine keywords for them."""
    ap.add_argument("--decode-pdl", choices=["true", "false"], default=None,
                    help="decode graphs of up to 16 rows with programmatic dependent launch")
    ap.add_argument("--decode-late-merge", choices=["true", "false"], default=None,
                    help="split-K partials of decode projections merged by the kernel after them")


def pdl_setting(args) -> dict:
    return {name: value == "true" for name, value in
            (("decode_pdl", args.decode_pdl), ("decode_late_merge", args.decode_late_merge)) if value is not None}


def add_model_args(ap) -> None:
    """The benches' `--preset`, `--model` and `--dtype`; `model_and_config` reads the first two."""
    ap.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    ap.add_argument("--model", default=None,
                    help="a local model folder instead of the preset (e.g. the tiny model, to try "
                         "the script on CPU with --dtype float32)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the engine's kv_cache_dtype: auto (the model's dtype) or fp8 (e4m3, one "
                         "byte a value; the rooflines count its bytes)")
    ap.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                    help="the engine's quantization: fp8 weights (W8A8) in the decoder layers' "
                         "projections; the rooflines count their bytes at one a parameter and "
                         "their FLOPs at the FP8 peak")


def kv_note(args) -> str:
    """", fp8 KV cache" / ", fp8 weights" for a title where --kv-cache-dtype / --quantization say so."""
    return ("" if args.kv_cache_dtype == "auto" else f", {args.kv_cache_dtype} KV cache") + (
        "" if getattr(args, "quantization", None) is None else f", {args.quantization} weights")


class WeightCost(NamedTuple):
    """A model's weights as a roofline counts them (the quantized projections at a byte a
    parameter and the FP8 peak):
    - bytes: read once a decode step: every matrix but the input embedding table, of which a
      step gathers only its rows (its own lm_head, tied or not, is read whole);
    - s_per_token: the FLOPs of a decode token at peak, 2 x the parameters it multiplies (the
      layers and lm_head; an embedding lookup multiplies nothing);
    - s_per_prompt_token: the same for a prompt token, whose logits are not computed;
    - s_per_sequence: the lm_head of each sequence's last prompt token (its first output)."""
    bytes: int
    s_per_token: float
    s_per_prompt_token: float
    s_per_sequence: float


def weight_cost(cfg: dict, elem: int, quantization: str | None = None) -> WeightCost:
    p = param_count(cfg)
    q = projection_param_count(cfg) if quantization == "fp8" else 0
    head = cfg["vocab_size"] * cfg["hidden_size"]               # the lm_head's matrix
    table = 0 if cfg.get("tie_word_embeddings") else head      # an untied embedding table
    layers_s = 2 * ((p - table - head - q) / BF16_DENSE_FLOPS + q / FP8_DENSE_FLOPS)
    head_s = 2 * head / BF16_DENSE_FLOPS
    return WeightCost(bytes=(p - table - q) * elem + q, s_per_token=layers_s + head_s,
                      s_per_prompt_token=layers_s, s_per_sequence=head_s)


def kv_elem_bytes(args) -> int:
    """Bytes of one KV-cache value for the benches' --dtype and --kv-cache-dtype, by the engine's
    own rule (engine/model_runner.kv_cache_dtype)."""
    import torch
    from engine.model_runner import kv_cache_dtype
    dtype = kv_cache_dtype(args.kv_cache_dtype, getattr(torch, args.dtype), torch.device("cpu"))
    return torch.empty((), dtype=dtype).element_size()


def model_and_config(preset: str, model: str | None) -> tuple[str, dict]:
    """The benches' `--preset` / `--model`: a local model folder (e.g. the tiny model) and its
    config.json, or the preset's folder (dummy weights) and config."""
    if not model:
        return preset_dir(preset), PRESETS[preset]
    with open(os.path.join(model, "config.json")) as f:
        return model, json.load(f)


def bench_tokenizer(out_dir: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer for a model with random weights: the tiny model's (trained on
    the shipped corpus, so prompts tokenize like text) with its vocabulary padded to
    `vocab_size` by made-up words. A random model samples ids across its whole vocabulary;
    each of them then decodes to text (" kavo", " brel", ...), so detokenization costs what it
    costs with a real tokenizer. The padding words are never produced by encoding."""
    from scripts.make_tiny_model import train_tokenizer
    train_tokenizer(out_dir)
    path = os.path.join(out_dir, "tokenizer.json")
    with open(path) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    used = set(vocab)
    n = 0
    for token_id in range(len(vocab), vocab_size):
        while True:
            k, word = n, ""
            n += 1
            while True:                 # bijective base 26: a, b, ..., z, aa, ab, ...
                k, r = divmod(k, 26)
                word = letters[r] + word
                if k == 0:
                    break
                k -= 1
            word = "\u0120" + word     # byte-level "Ġ": a leading space
            if word not in used:
                break
        vocab[word] = token_id
        used.add(word)
    with open(path, "w") as f:
        json.dump(spec, f, ensure_ascii=False)


def param_count(cfg: dict) -> int:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i + 2 * h
    embed = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return cfg["num_hidden_layers"] * per_layer + embed + h


def projection_param_count(cfg: dict) -> int:
    """The decoder layers' four projections (what EngineConfig.quantization = "fp8" quantizes)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return cfg["num_hidden_layers"] * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i)


def kv_bytes_per_token(cfg: dict, elem_bytes: int = 2) -> int:
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * d * elem_bytes


def capture_graph(call):
    """`call` captured in a CUDA graph after one warm-up call on a side stream (Triton compiles,
    allocations and autotuning happen outside the capture); returns (graph, what the captured
    call returned)."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    torch.cuda.synchronize()
    return graph, out


def process_cmdlines():
    """(pid, command line) of every process on this machine (Linux /proc); gone ones skipped."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                yield int(pid), f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue


def hardware() -> dict:
    info = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def git_commit() -> str:
    """The commit measured; the GPU machine gets a copy without history, so BENCH_COMMIT says."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def graph_us_a_call(call, times: int) -> float:
    """`call` made `times` times in one CUDA graph: the median replay (triton's do_bench, which
    flushes L2 before each) in us a call. The graph is replayed once more and synchronised, so
    what the calls wrote is in place when this returns."""
    import torch
    import triton.testing
    graph, _ = capture_graph(lambda: [call() for _ in range(times)])
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median")
    graph.replay()
    torch.cuda.synchronize()
    return ms * 1e3 / times


def write_probe(path: str, rows: list[dict], **meta) -> None:
    """A GPU probe's rows as JSON at `path`, with the commit and hardware measured and `meta`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"commit": git_commit(), "hardware": hardware(), **meta, "rows": rows}, f, indent=1)


def dump_rows(path: str | None, rows: list[dict]) -> None:
    """The rows as JSON at `path` (a tool's optional --out); nothing when None."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


# A list of numbers as json.dumps(indent=...) lays it out: a raw newline after "[", which no
# JSON string holds (they escape theirs), so only lists are matched.
_NUMBER_LIST = re.compile(r"\[\n\s+(-?[\d.eE+-]+(?:,\n\s+-?[\d.eE+-]+)*)\n\s*\]")


def results_json(doc: dict) -> str:
    """JSON indented for reading, with lists of numbers on one line each: a served run's
    per-request timelines, one number a line, made its record ~1 MB (the repository travels
    to the GPU machine whole, within a size limit)."""
    return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                            json.dumps(doc, indent=2))


def write_results(out_prefix: str, meta: dict, rows: list[dict], table: list[str],
                  echo: bool = True) -> None:
    """`out_prefix`.json (everything) and `out_prefix`.md (the table with its provenance), and
    the latter printed with `echo` (off for a bench that rewrites its results after each row)."""
    os.makedirs(os.path.dirname(out_prefix) or ".", exist_ok=True)
    head = [f"# {meta['title']}", "",
            f"Hardware: {meta['hardware']}. Commit `{meta['commit']}`.",
            f"Command: `{meta['command']}`", ""]
    # Through a temporary file: a run killed while writing keeps the previous results whole.
    for path, text in ((out_prefix + ".json", results_json({"meta": meta, "results": rows})),
                       (out_prefix + ".md", "\n".join(head + table) + "\n")):
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    if echo:
        print("\n".join(head + table))


def step_table(rows: list[dict], label_keys: list[str]) -> list[str]:
    """Markdown: where a step's time went (each row's "step_ms", StepTimes.per_step_ms), per
    row labelled by `label_keys`. Host phases are back to back; wall - gpu is roughly what the
    GPU waited for the host. Graph steps: the decode graph's and those cut at attention (steps
    with prompt chunks; their share in brackets). GPU ms per decode graph step, per step cut at
    attention and per other (eager) step, where timed."""
    from engine.step_timing import PHASES
    head = (["| " + " | ".join(label_keys) + " | " + " | ".join(PHASES)
             + " | wall ms | GPU ms | GPU idle | graph steps (cut) | GPU ms a decode graph step "
               "| GPU ms a cut step | GPU ms an eager step |"],
            ["| " + " | ".join("---" for _ in label_keys) + " | "
             + " | ".join("---:" for _ in PHASES) + " | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"])
    out = head[0] + head[1]
    for r in rows:
        ms = r["step_ms"]
        gpu = ms.get("gpu")
        idle = f"{100 * max(ms['wall'] - gpu, 0) / ms['wall']:.0f}%" if gpu and ms["wall"] else "-"
        out.append("| " + " | ".join(str(r[k]) for k in label_keys) + " | "
                   + " | ".join(f"{ms[p]:.3f}" for p in PHASES)
                   + f" | {ms['wall']:.3f} | {'-' if gpu is None else f'{gpu:.3f}'} | {idle} | "
                   + f"{100 * ms['graph_step_share']:.0f}% "
                   + f"({100 * ms.get('piecewise_step_share', 0.0):.0f}%) | "
                   + " | ".join(f"{ms[k]:.3f}" if k in ms else "-"
                                for k in ("gpu_graph_step", "gpu_piecewise_step", "gpu_other_step"))
                   + " |")
    return out


class FirstStepClock:
    """When `core`'s first step after this starts (perf_counter seconds in `.t`, None before), by
    wrapping core.step: how long a generate call spent on its prompts before the GPU got work."""

    def __init__(self, core):
        self.core, self.t, self._step = core, None, core.step
        core.step = self._timed_step

    def _timed_step(self):
        if self.t is None:
            self.t = time.perf_counter()
        return self._step()

    def close(self) -> None:
        self.core.step = self._step


class StepTrace:
    """Every engine step of `core` from here on, by wrapping core.step (like FirstStepClock):
    when it started, its host phases and the GPU's time (engine/step_timing.py; with
    `gpu_events` on), the rows running after it and the requests it finished. `.rows` once
    closed; `summary()`: the GPU's busy time (a run's elapsed time minus it is the GPU's idle
    time), the host time in steps beyond the GPU's step (an upper bound on idle time within
    steps: an eager launch that waits for room in the GPU's queue counts too), the time between
    steps (the caller's own work, e.g. LLM.generate's outputs) and the steps most over."""

    FIELDS = ("t_ms", "schedule", "prepare", "launch", "wait", "post", "update", "gpu", "graph",
              "running", "outputs", "finished")

    def __init__(self, core):
        self.core, self.rows, self._step = core, [], core.step
        self._t0 = time.perf_counter()
        core.step = self._traced_step

    def _traced_step(self):
        times = self.core.times
        before, t = times.copy(), time.perf_counter()
        outs = self._step()
        d = times.since(before)
        self.rows.append([round(1e3 * (t - self._t0), 3)]
                         + [round(1e3 * getattr(d, p), 3) for p in
                            ("schedule", "prepare", "launch", "wait", "post", "update", "gpu")]
                         + [d.graph_steps, self.core.scheduler.num_running, len(outs),
                            sum(o.finish_reason is not None for o in outs)])
        return outs

    def close(self) -> None:
        self.core.step = self._step

    def write(self, path: str) -> None:
        """The rows, with their field names, to `path` (JSON)."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({"fields": self.FIELDS, "rows": self.rows}, f)

    def summary(self, top: int = 15) -> dict:
        """The GPU's time summed, host time in steps beyond the GPU's (summed where positive),
        the gaps between steps, and the steps with the most host time over the GPU's."""
        host = lambda r: sum(r[1:7])  # noqa: E731 - schedule .. update
        over = [(max(0.0, host(r) - r[7]), i) for i, r in enumerate(self.rows)]
        gaps = [self.rows[i + 1][0] - (r[0] + host(r)) for i, r in enumerate(self.rows[:-1])]
        worst = sorted(over, reverse=True)[:top]
        return {"steps": len(self.rows),
                "gpu_busy_ms": round(sum(r[7] for r in self.rows), 1),
                "host_over_gpu_ms": round(sum(o for o, _ in over), 1),
                "between_steps_ms": round(sum(gaps), 1),
                "worst": [dict(zip(("step",) + self.FIELDS, [i] + self.rows[i]), over_ms=round(o, 3))
                          for o, i in worst]}


class StepProfiler:
    """torch.profiler over engine steps [start, start + count) of `core` (counted from here),
    by wrapping core.step; `.tables` (CUDA and CPU kernel tables) once the window closed. GPU
    only: on CPU it profiles nothing."""

    def __init__(self, core, start: int, count: int, kernels_path: str | None = None):
        import torch
        self.core, self.start, self.count, self.tables = core, start, count, None
        self.kernels_path = kernels_path    # where to write every GPU kernel's (name, start us, us)
        self._step, self._i, self._prof = core.step, 0, None
        if count > 0 and core.device.type == "cuda":
            core.step = self._profiled_step
        self._torch = torch

    def _profiled_step(self):
        torch = self._torch
        if self._i == self.start:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA])
            self._prof.__enter__()
        out = self._step()
        self._i += 1
        if self._i == self.start + self.count:
            # Only the window ends: wrappers installed after this one (bench_shared_prefix's
            # step trace) still call through it, so core.step stays as they left it.
            self._end_window()
        return out

    def close(self) -> None:
        """Ends the window (early if the run ended first) and restores core.step, if no
        wrapper installed after this one still holds it (they close first)."""
        if self.core.step == self._profiled_step:
            self.core.step = self._step
        self._end_window()

    def _end_window(self) -> None:
        if self._prof is None:
            return
        self._torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        if self.kernels_path:
            kernels = [(e.name, e.time_range.start, e.time_range.elapsed_us())
                       for e in self._prof.events() if e.device_type == self._torch.autograd.DeviceType.CUDA]
            with open(self.kernels_path, "w") as f:
                json.dump(sorted(kernels, key=lambda k: k[1]), f)
        averages = self._prof.key_averages()
        self.tables = {"steps": min(self._i, self.start + self.count) - self.start,
                       "cuda": averages.table(sort_by="cuda_time_total", row_limit=30,
                                              max_name_column_width=60),
                       "cpu": averages.table(sort_by="self_cpu_time_total", row_limit=20,
                                             max_name_column_width=60)}
        self._prof = None


# SamplingParams fields that change how many tokens a request makes: the benchmarks count
# exactly their output length a request (max_tokens with ignore_eos), so these would skew it.
COUNT_CHANGING_FIELDS = ("n", "stop", "stop_token_ids")


def sampling_fields(text: str, what: str = "--sampling") -> dict:
    """An argparse type: JSON SamplingParams fields for a benchmark's requests, none of
    COUNT_CHANGING_FIELDS."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{what}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{what}: SamplingParams fields as a JSON object, got {text!r}")
    bad = [k for k in COUNT_CHANGING_FIELDS if k in value]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{what}: {', '.join(bad)} would change how many tokens a request makes, and the "
            f"results count exactly the output length a request; leave {'it' if len(bad) == 1 else 'them'} out")
    return value


def parse_setting(text: str) -> tuple[str, dict]:
    """'name=JSON' -> (name, SamplingParams fields)."""
    name, sep, fields = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a setting is NAME=JSON, got {text!r}")
    return name, sampling_fields(fields, f"setting {name}")
