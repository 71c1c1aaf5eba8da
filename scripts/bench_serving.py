"""What a client of tritonserver gets, beside what the engine gives directly, on the same
prompts and settings.

    python scripts/bench_serving.py                      # GPU: Llama-3.1-8B shape, dummy weights
    python scripts/bench_serving.py --gpus 2             # one llm instance per GPU
    python scripts/bench_serving.py --concurrency 32     # CPU: the tiny model

Three paths, each after a warm-up round that is reported on its own (the first traffic an
engine sees):

  direct    the AsyncEngine in a process of its own per GPU (the core in its own process, as
            in the server), driven by a closed loop of `c` concurrent requests;
  llm       tritonserver with this repository (llm KIND_GPU, one instance per GPU; on CPU the
            repository's KIND_CPU), gRPC streaming, driven by perf_analyzer --streaming;
  llm_bls   the same server, the non-streaming model, driven by perf_analyzer.

Every run sends `waves * c` requests (at least MIN_REQUESTS) of `--prompt-tokens` prompt tokens
(distinct prompts cut from the shipped corpus, new to the engine in every round: none is
answered from the prefix cache; the direct and the served round at a concurrency send the
same ones) and exactly `--output-tokens` output tokens (greedy, ignore_eos), `c` at a time. Output tok/s = requests * output tokens / (last answer -
first send). Per request: TTFT = first response - send; ITL = (last response - first
response) / (output tokens - 1), as genai-perf counts it (a response may carry several tokens).
llm_bls has one response per request, so its TTFT and ITL are the server's own histograms
(llm_time_to_first_token_seconds, llm_inter_token_latency_seconds; quantiles interpolated
within their buckets). Also recorded: the server's responses and tokens per response, the
serving loop's lag, and Triton's queue time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from scripts.bench_common import (PRESETS, git_commit, hardware, preset_dir,  # noqa: E402
                                  process_cmdlines, write_results)

MIN_REQUESTS = 8
SERVER_START_S = 900.0
TINY_MODEL = os.path.join(ROOT, "models", "tiny-llama")


# ---------------------------------------------------------------------------- workload
def make_prompts(model_dir: str, num: int, num_tokens: int) -> list[str]:
    """`num` distinct prompts of about `num_tokens` tokens: a numbered line, then corpus text
    from a different offset each (no two share a first KV block: none is served from
    another's prefix cache)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(os.path.join(ROOT, "data", "tiny_corpus.txt")) as f:
        corpus = " ".join(f.read().split())
    corpus_ids = tok.encode(" " + corpus, add_special_tokens=False)
    prompts = []
    for i in range(num):
        head = tok.encode(f"Request {i}:", add_special_tokens=False)
        need = max(num_tokens - 1 - len(head), 0)
        start = (i * 37) % len(corpus_ids)
        body = (corpus_ids[start:] + corpus_ids)[:need]
        prompts.append(tok.decode(head + body))
    return prompts


def engine_settings(args, on_gpu: bool) -> dict[str, str]:
    """Over the repository's llm parameters (the CPU defaults): these, then --set."""
    settings = {"max_num_seqs": str(max(max(args.concurrency), 16)),
                "max_model_len": str(args.prompt_tokens + args.output_tokens + 64)}
    if on_gpu:      # "" keeps the engine's default: KV sized from memory
        settings.update(dtype="bfloat16", num_kv_blocks="", cpu_threads="",
                        max_num_batched_tokens="2048")
    if args.preset:
        settings["load_format"] = "dummy"
    for item in args.set:
        key, _, value = item.partition("=")
        settings[key] = value
    return settings


def num_requests(args, c: int) -> int:
    return max(args.waves * c, MIN_REQUESTS)


class PromptRounds:
    """Which prompts each round sends. Every round's prompts are new to the engine that runs
    it (an earlier round's would be answered from the prefix cache, skipping their prefill:
    a warm-up round on the same prompts made every later round look faster), and the direct
    and the first served round at a concurrency send the same prompts; a server's later
    rounds at that concurrency (other models, other drivers) get prompts of their own."""

    def __init__(self, args) -> None:
        # --reuse-prompts: every round sends the warm-up's prompts again, their prefill
        # answered from the prefix cache: steps are nearly all decode, tokens come at the
        # highest rate, the hardest case for the response path.
        self.reuse = getattr(args, "reuse_prompts", False)
        self.n = {c: num_requests(args, c) for c in args.concurrency}
        self.offsets = {"warm": 0}
        pos = max(self.n.values())
        for c in args.concurrency:
            self.offsets[c] = pos
            pos += self.n[c]
        self._next = pos
        self._served: set = set()
        # Enough for every round: a warm-up, then each concurrency per model and driver.
        self.total = pos + sum(self.n.values()) * len(args.models) * len(args.drivers)

    def warm(self) -> int:
        return self.offsets["warm"]

    def direct(self, c: int) -> int:
        return self.offsets["warm" if self.reuse else c]

    def served(self, c: int) -> int:
        if self.reuse:
            return self.offsets["warm"]
        if c not in self._served:
            self._served.add(c)
            return self.offsets[c]
        self._next += self.n[c]
        return self._next - self.n[c]


def summarize(starts, firsts, lasts, ends, output_tokens: int, concurrency: int = 0) -> dict:
    """Client-side figures of one run (times in seconds, one entry per request)."""
    starts, firsts, lasts, ends = (np.asarray(a, dtype=np.float64)
                                   for a in (starts, firsts, lasts, ends))
    span = float(ends.max() - starts.min())
    ttft = (firsts - starts) * 1e3
    itl = (lasts - firsts) * 1e3 / max(output_tokens - 1, 1)

    def pct(a, q):
        return round(float(np.percentile(a, q)), 3)
    t0 = float(starts.min())
    return {"requests": int(len(starts)), "seconds": round(span, 3),
            # each request's (send, first response, last response) in ms from the first send:
            # where the time between a request and its context's next one goes
            "timeline_ms": [[round(1e3 * (a - t0), 1), round(1e3 * (b - t0), 1),
                             round(1e3 * (c - t0), 1)]
                            for a, b, c in zip(starts.tolist(), firsts.tolist(),
                                               lasts.tolist())],
            "output_tok_s": round(len(starts) * output_tokens / span, 1),
            **full_load(starts, firsts, lasts, output_tokens, concurrency),
            # requests in flight on average: below the concurrency, the client left gaps
            "mean_in_flight": round(float((ends - starts).sum()) / span, 1),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            **reissue_gaps(starts, ends, concurrency)}


def full_load(starts, firsts, lasts, output_tokens: int, c: int) -> dict:
    """Output tok/s while the client has all its slots in use: from the c-th send (every slot
    filled once) to the last send (after it, slots empty as the run drains). The whole-run
    figure also charges the server with the client's ramp-up (perf_analyzer's processes and
    threads start over seconds) and the drain. A request's tokens are counted where they
    came: the first at its first response, the rest spread evenly to its last response (one
    response: over the time it was out)."""
    if c <= 0 or len(starts) <= c:
        return {}
    sends = np.sort(starts)
    t0, t1 = sends[c - 1], sends[-1]
    if t1 <= t0:
        return {}
    single = (lasts - firsts) < 1e-6
    # one response (llm_bls): its tokens were made while it was out, spread over that time
    begin = np.where(single, starts, firsts)
    spread = np.clip(np.minimum(lasts, t1) - np.maximum(begin, t0), 0, None) / np.maximum(
        lasts - begin, 1e-9)
    tokens = np.where(single, output_tokens * spread,
                      ((firsts >= t0) & (firsts <= t1)) + (output_tokens - 1) * spread)
    busy = np.clip(np.minimum(lasts, t1) - np.maximum(starts, t0), 0, None)
    return {"full_load_tok_s": round(float(tokens.sum()) / (t1 - t0), 1),
            "full_load_s": round(float(t1 - t0), 3),
            "full_load_in_flight": round(float(busy.sum()) / (t1 - t0), 1)}


def reissue_gaps(starts, ends, c: int) -> dict:
    """In a closed loop of c, the k-th request to end frees the slot of the (c+k)-th to be
    sent: the time between the two is what the client (or the server's answer path) adds
    between requests. Matched in order of time, so per slot only on average."""
    if c <= 0 or len(starts) <= c:
        return {}
    gaps = (np.sort(starts)[c:] - np.sort(ends)[:len(starts) - c]) * 1e3
    return {"reissue_gap_p50_ms": round(float(np.percentile(gaps, 50)), 3),
            "reissue_gap_p90_ms": round(float(np.percentile(gaps, 90)), 3),
            "reissue_gap_max_ms": round(float(gaps.max()), 3)}


# ---------------------------------------------------------------------------- direct
def start_delay_s(worker: int, c: int, groups: int, stagger_s: float) -> float:
    """When worker `worker` of `c` starts: the workers form `groups` groups of consecutive
    indices (sizes differing by at most one), the g-th starting g x stagger_s late."""
    return (worker * groups // c) * stagger_s


async def _closed_loop(engine, prompts: list[str], params, c: int, total: int, tag: str,
                       groups: int = 1, stagger_s: float = 0.0):
    """`c` workers send `total` requests back to back (`prompts` holds at least `total`); per
    request (start, first, last, end). With `stagger_s`, the workers form `groups` groups, the
    g-th starting g x stagger_s late (as separate client processes start), each with its
    share of the requests."""
    times: list[tuple[float, float, float, float]] = []
    groups = max(1, min(groups, c)) if stagger_s else 1
    # Each group sends its own share of the requests, as each perf_analyzer process does.
    sizes = [sum(1 for w in range(c) if w * groups // c == g) for g in range(groups)]
    shares = [total * sum(sizes[:g]) // c for g in range(groups + 1)]
    counters = [iter(range(shares[g], shares[g + 1])) for g in range(groups)]

    async def worker(w: int):
        if stagger_s:
            await asyncio.sleep(start_delay_s(w, c, groups, stagger_s))
        for i in counters[w * groups // c]:
            start = time.time()
            first = last = None
            async for out in engine.generate(prompts[i], params, f"{tag}-{i}"):
                if out.outputs[0].token_ids:
                    last = time.time()
                    first = first or last
            times.append((start, first, last, time.time()))
    await asyncio.gather(*(worker(w) for w in range(c)))
    return times


def direct_worker(spec: dict) -> None:
    """One GPU's (or the CPU's) AsyncEngine. Reads commands on stdin ("run C N TAG FIRST
    GROUPS STAGGER_S": c at a time, n requests with prompts FIRST.., or "quit"),
    answers each with a JSON line of per-request times; says "ready" once the engine is up."""
    from engine import AsyncEngine, SamplingParams
    from engine.config import EngineConfig
    config = EngineConfig.from_strings(spec["settings"])
    engine = AsyncEngine(config)
    params = SamplingParams(max_tokens=spec["output_tokens"], temperature=0.0, ignore_eos=True)
    prompts = spec["prompts"]
    print("ready", flush=True)
    loop = asyncio.new_event_loop()
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            c, n, tag, first = int(cmd[1]), int(cmd[2]), cmd[3], int(cmd[4])
            groups, stagger_s = int(cmd[5]), float(cmd[6])
            before = engine.get_stats()
            times = loop.run_until_complete(
                _closed_loop(engine, prompts[first:first + n], params, c, n, tag, groups,
                             stagger_s))
            after = engine.get_stats()
            print(json.dumps({"times": times, "steps": after.num_steps - before.num_steps,
                              "graph_steps": after.num_graph_steps - before.num_graph_steps}),
                  flush=True)
    finally:
        engine.shutdown()
        loop.close()


class DirectEngines:
    """One direct_worker process per GPU; `run(c, n)` spreads c and n over them at once."""

    def __init__(self, args, settings: dict, prompts: list[str], gpus: int) -> None:
        self.procs = []
        self.groups, self.stagger_s = args.clients, args.direct_stagger_ms / 1e3
        spec = {"settings": settings, "prompts": prompts, "output_tokens": args.output_tokens}
        spec_path = tempfile.mkstemp(prefix="bench-serving-", suffix=".json")[1]
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        for gpu in range(max(gpus, 1)):
            env = dict(os.environ)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = str(gpu)
            self.procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--direct-worker", spec_path],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT))
        for p in self.procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"direct engine did not start (said {line!r})")

    def run(self, c: int, n: int, tag: str, first: int) -> tuple[list, dict]:
        """Per-request times, and the share of the engines' steps that ran as a CUDA graph.
        The n requests send prompts first, first + 1, ..."""
        k = len(self.procs)
        start = first
        for i, p in enumerate(self.procs):
            ci = c // k + (i < c % k)
            ni = n // k + (i < n % k)
            p.stdin.write(f"run {max(ci, 1)} {max(ni, 1)} {tag} {start} "
                          f"{self.groups} {self.stagger_s}\n")
            start += max(ni, 1)
            p.stdin.flush()
        times, steps, graph_steps = [], 0, 0
        for p in self.procs:
            answer = json.loads(p.stdout.readline())
            times += answer["times"]
            steps += answer["steps"]
            graph_steps += answer["graph_steps"]
        return times, ({"graph_step_fraction": round(graph_steps / steps, 3)} if steps else {})

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write("quit\n")
                p.stdin.flush()
            except OSError:
                pass
        for p in self.procs:
            p.wait(timeout=120)


def run_direct(args, settings, prompts, rounds: PromptRounds, gpus, on_row) -> list[dict]:
    """The direct AsyncEngine's rounds; `on_row(row)` as each ends."""
    rows = []
    engines = DirectEngines(args, settings, prompts, gpus)
    try:
        c_max = max(args.concurrency)
        t, steps = engines.run(c_max, num_requests(args, c_max), "warm", rounds.warm())
        rows.append({"path": "direct", "round": "first", "concurrency": c_max,
                     **summarize(*zip(*t), args.output_tokens, c_max), **steps})
        print({k: v for k, v in rows[-1].items() if k != "timeline_ms"}, flush=True)
        on_row(rows[-1])
        for c in args.concurrency:
            cpu0, w0 = cpu_times(), time.monotonic()
            t, steps = engines.run(c, num_requests(args, c), f"c{c}", rounds.direct(c))
            cpu = cpu_use(cpu0, cpu_times(), time.monotonic() - w0)
            rows.append({"path": "direct", "round": "steady", "concurrency": c,
                         **summarize(*zip(*t), args.output_tokens, c), "cpu_cores": cpu,
                         **steps})
            print({k: v for k, v in rows[-1].items() if k != "timeline_ms"}, flush=True)
            on_row(rows[-1])
    finally:
        engines.close()
    return rows


# ---------------------------------------------------------------------------- served
def perf_analyzer_path() -> str:
    for cand in (os.path.join(os.path.dirname(sys.executable), "perf_analyzer"),
                 shutil.which("perf_analyzer")):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise FileNotFoundError("perf_analyzer not found (make venv; on the GPU machine "
                            "bash .gpu-kit/install.sh)")


def grpc_address(server) -> str:
    """The server's gRPC address by IP. gRPC resolves "localhost" through DNS; on the GPU
    machine (no reachable DNS server) that made each perf_analyzer start 3.2-3.4 s late and
    open its streams over seconds, in steps as earlier requests finished
    (scripts/diag_stream_ramp.py): a client artifact charged to the server."""
    return f"127.0.0.1:{server.grpc_port}"


def write_input_data(path: str, prompts: list[str], output_tokens: int, stream: bool) -> None:
    params = json.dumps({"max_tokens": output_tokens, "temperature": 0, "ignore_eos": True})
    entries = [{"text_input": [p], "sampling_parameters": [params]} for p in prompts]
    if stream:
        for e in entries:
            e["stream"] = [True]
    with open(path, "w") as f:
        json.dump({"data": entries}, f)


def client_prompts(prompts: list[str], n: int, clients: int) -> list[list[str]]:
    """The prompts each of `clients` perf_analyzer processes cycles through for n requests:
    client k gets prompts k, k + clients, ... of the first n (never none)."""
    return [prompts[k:n:clients] or prompts[k % len(prompts):][:1] for k in range(clients)]


def run_perf_analyzer(server, model: str, c: int, n: int, prompts: list[str], work: str,
                      output_tokens: int, clients: int = 1) -> dict:
    """`clients` perf_analyzer processes at once, c and n shared among them: one process
    handles about 5,000 streamed responses/s (seen on the H200 host: beyond that it lets its
    requests in flight drop), so a fast server needs several to be kept busy. Client k sends
    prompts k, k + clients, ... of the first n: together the n prompts the direct engine and
    the python client send. (Each used to read the whole list from its start: 4 clients sent
    the first quarter 4 times, so a later round with all n prompts found 3/4 of them outside
    the prefix cache, and prefilled them, where the direct engine's steady round did not.)"""
    clients = max(1, min(clients, c))
    procs, exports = [], []
    for k in range(clients):
        ck, nk = c // clients + (k < c % clients), n // clients + (k < n % clients)
        data = os.path.join(work, f"input-{model}-{c}-{k}.json")
        write_input_data(data, client_prompts(prompts, n, clients)[k], output_tokens,
                         stream=model == "llm")
        exports.append(os.path.join(work, f"export-{model}-{c}-{k}.json"))
        cmd = [perf_analyzer_path(), "-m", model, "-i", "grpc", "-u", grpc_address(server),
               "--input-data", data, "--concurrency-range", str(ck),
               "--request-count", str(max(nk, 1)),
               # A thread per request in flight: with fewer, the threads, busy with many
               # streamed responses each, kept only about half of 64 requests in flight.
               "--max-threads", str(max(ck, 4)), "--profile-export-file", exports[-1]]
        if model == "llm":
            cmd.append("--streaming")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    reqs = []
    for proc, export in zip(procs, exports):
        out, _ = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"perf_analyzer failed ({proc.returncode}):\n{out[-3000:]}")
        with open(export) as f:
            exp = json.load(f)
        os.remove(export)
        reqs += [r for e in exp["experiments"] for r in e["requests"]
                 if r["response_timestamps"]]
    starts = [r["timestamp"] / 1e9 for r in reqs]
    firsts = [r["response_timestamps"][0] / 1e9 for r in reqs]
    lasts = [r["response_timestamps"][-1] / 1e9 for r in reqs]
    out = summarize(starts, firsts, lasts, lasts, output_tokens, c)
    out["responses_per_request"] = round(
        sum(len(r["response_timestamps"]) for r in reqs) / max(len(reqs), 1), 2)
    out["clients"] = clients
    return out


def py_client_worker(spec: dict) -> None:
    """A closed loop of Python gRPC clients (tritonclient.grpc.aio), one stream per context: a
    second client beside perf_analyzer, to tell the client's gaps from the server's. Reads
    "go" on stdin once connected; prints a JSON list of per-request (send, first, last)."""
    import tritonclient.grpc.aio as grpcclient
    import tritonclient.grpc as grpcsync
    model, stream_mode = spec["model"], spec["model"] == "llm"
    params = json.dumps({"max_tokens": spec["output_tokens"], "temperature": 0,
                         "ignore_eos": True})

    def make_inputs(prompt: str) -> list:
        arrays = {"text_input": np.array([prompt.encode()], dtype=np.object_),
                  "sampling_parameters": np.array([params.encode()], dtype=np.object_),
                  "return_finish_reason": np.array([True])}
        if stream_mode:
            arrays["stream"] = np.array([True])
        out = []
        for name, a in arrays.items():
            t = grpcsync.InferInput(name, list(a.shape), "BYTES" if a.dtype == object else "BOOL")
            t.set_data_from_numpy(a)
            out.append(t)
        return out

    counter = iter(range(spec["first"], spec["first"] + spec["n"]))
    times: list = []

    async def context(client) -> None:
        if not stream_mode:
            for i in counter:
                start = time.time()
                await client.infer(model, make_inputs(spec["prompts"][i % len(spec["prompts"])]))
                now = time.time()
                times.append((start, now, now))
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (item := await queue.get()) is not None:
                yield item
        responses = client.stream_infer(requests())
        for i in counter:
            start, first, last = time.time(), None, None
            await queue.put({"model_name": model, "request_id": f"py-{i}",
                             "inputs": make_inputs(spec["prompts"][i % len(spec["prompts"])])})
            while True:
                result, error = await responses.__anext__()
                if error is not None:
                    raise RuntimeError(str(error))
                last = time.time()
                first = first or last
                if result.as_numpy("finish_reason") is not None:
                    break
            times.append((start, first, last))
        await queue.put(None)

    async def main() -> None:
        clients = [grpcclient.InferenceServerClient(spec["url"]) for _ in range(spec["c"])]
        for cl in clients:
            await cl.is_server_ready()
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await asyncio.gather(*(context(cl) for cl in clients))
        for cl in clients:
            await cl.close()
    asyncio.run(main())
    print(json.dumps(times), flush=True)


def run_py_client(server, model: str, c: int, n: int, prompts: list[str], output_tokens: int,
                  procs: int) -> dict:
    """`procs` processes of py_client_worker share c and n."""
    procs = max(1, min(procs, c))
    workers, first = [], 0
    for k in range(procs):
        ck, nk = c // procs + (k < c % procs), n // procs + (k < n % procs)
        spec_path = tempfile.mkstemp(prefix="bench-pyclient-", suffix=".json")[1]
        with open(spec_path, "w") as f:
            json.dump({"url": grpc_address(server), "model": model, "c": ck, "n": nk, "first": first,
                       "prompts": prompts, "output_tokens": output_tokens}, f)
        first += nk
        workers.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--py-client-worker", spec_path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT))
    for w in workers:
        if w.stdout.readline().strip() != "ready":
            raise RuntimeError("python client did not start")
    for w in workers:
        w.stdin.write("go\n")
        w.stdin.flush()
    times = []
    for w in workers:
        out, _ = w.communicate(timeout=3600)
        if w.returncode != 0:
            raise RuntimeError(f"python client failed ({w.returncode})")
        times += json.loads(out.strip().splitlines()[-1])
    starts, firsts, lasts = zip(*times)
    out = summarize(starts, firsts, lasts, lasts, output_tokens, c)
    out["clients"] = procs
    return out


def cpu_times() -> dict[str, float]:
    """CPU seconds used so far by each kind of process on this machine (Linux /proc): the
    server, its stubs, the engine's core and tokenizer processes, the load generators."""
    tick = os.sysconf("SC_CLK_TCK")
    kinds = {"engine.core_process": "engine core", "engine.tokenizer_process": "tokenizer",
             "triton_python_backend_stub": "python stubs", "tritonserver": "tritonserver",
             "perf_analyzer": "perf_analyzer", "--py-client-worker": "python clients",
             "--direct-worker": "direct engine"}
    out: dict[str, float] = {}
    for pid, cmd in process_cmdlines():
        kind = next((v for k, v in kinds.items() if k in cmd), None)
        if not kind:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_use(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Cores busy on average per kind of process between two cpu_times()."""
    return {k: round((after[k] - before.get(k, 0.0)) / seconds, 2) for k in sorted(after)
            if seconds > 0 and after[k] - before.get(k, 0.0) > 0}


def children_cpu() -> float:
    """CPU seconds of this process's finished children (the load generators, once waited)."""
    t = os.times()
    return t.children_user + t.children_system


def server_side(before: dict, after: dict) -> dict:
    from scripts.server_probe import hist_delta
    out = {}
    for name, key in (("llm_time_to_first_token_seconds", "server_ttft"),
                      ("llm_inter_token_latency_seconds", "server_itl"),
                      ("llm_event_loop_lag_seconds", "loop_lag")):
        h = hist_delta(before, after, name)
        out[key] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in h.items()
                    if k in ("count", "p50_ms", "p99_ms", "mean_ms")}

    def delta(prefix):
        return sum(v for k, v in after.items() if k.startswith(prefix + "{")) - sum(
            v for k, v in before.items() if k.startswith(prefix + "{"))
    steps = delta("llm_engine_steps_total")
    if steps:       # the rest ran eagerly: prompt chunks in the step (or no graph, or CPU)
        out["graph_step_fraction"] = round(delta("llm_engine_graph_steps_total") / steps, 3)
    responses, tokens = delta("llm_responses_total"), delta("llm_response_tokens_total")
    if responses:
        out["server_tokens_per_response"] = round(tokens / responses, 2)
    return out


def scrape_published(metrics_url: str, before: dict, requests: int,
                     timeout_s: float = 30.0) -> dict:
    """The server's metrics once they include a run's `requests` finished requests (the model
    publishes them twice a second, so a scrape right after the last answer can miss some)."""
    from scripts.server_probe import scrape

    def finished(m):
        return sum(v for k, v in m.items() if k.startswith("llm_requests_finished_total{"))
    deadline = time.monotonic() + timeout_s
    while True:
        after = scrape(metrics_url)
        if finished(after) - finished(before) >= requests or time.monotonic() > deadline:
            return after
        time.sleep(0.1)     # polling the published state, not standing in for it


def triton_queue_us(metrics_url: str) -> dict[str, float]:
    """Triton's own cumulative queue time and request count per model."""
    import urllib.request
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        for name in ("nv_inference_queue_duration_us", "nv_inference_request_success"):
            if line.startswith(name + "{"):
                model = line.split('model="', 1)[1].split('"', 1)[0]
                out[f"{name}:{model}"] = out.get(f"{name}:{model}", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def make_repository(repo: str, model_dir: str, settings: dict[str, str], gpus: int
                    ) -> dict[str, str]:
    """The repository copy the server runs (llm KIND_GPU with GPUs); returns llm's parameters,
    which the direct engine takes too."""
    from scripts.tritonserver_env import copy_repository
    params = copy_repository(repo, model_dir, settings)
    if gpus:
        cfg_path = os.path.join(repo, "llm", "config.pbtxt")
        with open(cfg_path) as f:
            cfg = f.read().replace("kind: KIND_CPU", "kind: KIND_GPU")
        with open(cfg_path, "w") as f:
            f.write(cfg)
    return params


def run_served(args, repo, prompts, rounds: PromptRounds, gpus, work, on_row) -> list[dict]:
    """The served rounds, each model and driver; `on_row(row)` as each ends."""
    from scripts.server_probe import scrape
    from tests.tritonserver import start_server
    env_before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    rows = []
    server = None
    try:
        # The log goes beside the results from the start: it is there even if this is killed.
        log_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else work
        with start_server(repo, extra_args=args.server_arg, timeout_s=SERVER_START_S,
                          log_dir=log_dir) as server:
            c_max = max(args.concurrency)
            for model in args.models:
                runs = [(c_max, "first", args.drivers[0])] + [
                    (c, "steady", d) for c in args.concurrency for d in args.drivers]
                for c, rnd, driver in runs:
                    if rnd == "first" and model != args.models[0]:
                        continue                # one warm-up round per server
                    n = num_requests(args, c)
                    first = rounds.warm() if rnd == "first" else rounds.served(c)
                    these = prompts[first:first + n]
                    m0, q0 = scrape(server.metrics_url), triton_queue_us(server.metrics_url)
                    cpu0, w0, ch0 = cpu_times(), time.monotonic(), children_cpu()
                    if driver == "python":
                        r = run_py_client(server, model, c, n, these, args.output_tokens,
                                          args.py_clients)
                    else:
                        r = run_perf_analyzer(server, model, c, n, these, work,
                                              args.output_tokens, args.clients)
                    wall = time.monotonic() - w0
                    r["cpu_cores"] = cpu_use(cpu0, cpu_times(), wall)
                    r["cpu_cores"]["load generator"] = round((children_cpu() - ch0) / wall, 2)
                    m1 = scrape_published(server.metrics_url, m0, r["requests"])
                    q1 = triton_queue_us(server.metrics_url)
                    r.update(server_side(m0, m1))
                    n = q1.get(f"nv_inference_request_success:{model}", 0) - q0.get(
                        f"nv_inference_request_success:{model}", 0)
                    if n:
                        r["triton_queue_ms"] = round((q1[f"nv_inference_queue_duration_us:{model}"]
                                                      - q0[f"nv_inference_queue_duration_us:{model}"])
                                                     / n / 1e3, 3)
                    if model == "llm_bls":      # one response: the server's TTFT / ITL
                        for k in ("ttft", "itl"):
                            h = r.get(f"server_{k}", {})
                            r[f"{k}_p50_ms"], r[f"{k}_p99_ms"] = h.get("p50_ms"), h.get("p99_ms")
                    path = model if driver == "perf_analyzer" else f"{model} ({driver} client)"
                    rows.append({"path": path, "round": rnd, "concurrency": c, **r})
                    print({k: v for k, v in rows[-1].items() if k != "timeline_ms"}, flush=True)
                    on_row(rows[-1])
    finally:
        if server is not None and args.out:        # under a name that says what it is
            os.replace(server.log_path, args.out + ".server.log")
        if env_before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env_before
    return rows


# ---------------------------------------------------------------------------- report
def table(rows: list[dict]) -> list[str]:
    def base(key):
        return {r["concurrency"]: r.get(key) for r in rows
                if r["path"] == "direct" and r["round"] == "steady"}
    direct, direct_full = base("output_tok_s"), base("full_load_tok_s")
    out = ["| path | round | concurrency | output tok/s (vs direct) | at full load (vs direct) "
           "| in flight at full load | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
           "responses / request |",
           "| :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def f(v):
        return "-" if v is None else f"{v:.2f}"

    def vs(r, key, ref):
        v, b = r.get(key), ref.get(r["concurrency"])
        if v is None:
            return "-"
        if r["round"] != "steady" or not b:
            return f"{v:.0f}"
        return f"{v:.0f} ({100 * v / b:.1f}%)"
    for r in rows:
        out.append(f"| {r['path']} | {r['round']} | {r['concurrency']} | "
                   f"{vs(r, 'output_tok_s', direct)} | {vs(r, 'full_load_tok_s', direct_full)} | "
                   f"{r.get('full_load_in_flight', '-')} | "
                   f"{f(r.get('ttft_p50_ms'))} / {f(r.get('ttft_p99_ms'))} | "
                   f"{f(r.get('itl_p50_ms'))} / {f(r.get('itl_p99_ms'))} | "
                   f"{r.get('responses_per_request', '-')} |")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--direct-worker", help=argparse.SUPPRESS)
    ap.add_argument("--py-client-worker", help=argparse.SUPPRESS)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="a real architecture with dummy weights (default on GPU: llama-3.1-8b)")
    ap.add_argument("--model", help="a local model folder (default on CPU: the tiny model)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs to use, one llm instance each (default: 1 with CUDA, 0 without)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None,
                    help="default: 1 64 256 on GPU, 32 on CPU")
    ap.add_argument("--prompt-tokens", type=int, default=215)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--waves", type=int, default=4, help="requests per run = waves x concurrency")
    ap.add_argument("--models", nargs="+", default=["llm", "llm_bls"],
                    choices=["llm", "llm_bls"])
    ap.add_argument("--reuse-prompts", action="store_true",
                    help="every round sends the warm-up round's prompts (prefills answered "
                         "from the prefix cache: a decode-bound run at the highest token rate)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting for both paths (e.g. max_num_seqs=512)")
    ap.add_argument("--clients", type=int, default=1,
                    help="perf_analyzer processes per run, the concurrency shared among them")
    ap.add_argument("--drivers", nargs="+", default=["perf_analyzer"],
                    choices=["perf_analyzer", "python"],
                    help="load generators for the served runs: perf_analyzer (C++) and/or a "
                         "closed loop of tritonclient.grpc.aio streams (tells the client's "
                         "gaps from the server's)")
    ap.add_argument("--py-clients", type=int, default=4,
                    help="processes for the python driver, the concurrency shared among them")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="an extra tritonserver flag (e.g. --server-arg=--log-verbose=1)")
    ap.add_argument("--direct-stagger-ms", type=float, default=0.0,
                    help="the direct engine's closed loop starts as --clients groups, each this "
                         "much after the last (as perf_analyzer's processes do; default: all at "
                         "once)")
    ap.add_argument("--skip-direct", action="store_true")
    ap.add_argument("--skip-served", action="store_true")
    ap.add_argument("--out", default=None, help="results prefix (.json and .md)")
    args = ap.parse_args(argv)
    if args.direct_worker:
        with open(args.direct_worker) as f:
            direct_worker(json.load(f))
        return {}
    if args.py_client_worker:
        with open(args.py_client_worker) as f:
            py_client_worker(json.load(f))
        return {}

    import torch
    on_gpu = torch.cuda.is_available()
    gpus = args.gpus if args.gpus is not None else (1 if on_gpu else 0)
    if gpus and not on_gpu:
        raise SystemExit("--gpus needs CUDA")
    if args.model is None and args.preset is None and on_gpu:
        args.preset = "llama-3.1-8b"
    if args.preset:
        model_dir = preset_dir(args.preset, tokenizer=True)
    else:
        model_dir = os.path.abspath(args.model or TINY_MODEL)
        if not os.path.isdir(model_dir):
            from scripts.make_tiny_model import make_tiny_model
            make_tiny_model(model_dir)
    args.concurrency = args.concurrency or ([1, 64, 256] if on_gpu else [32])
    work = tempfile.mkdtemp(prefix="bench-serving-")
    repo = os.path.join(work, "repo")
    settings = make_repository(repo, model_dir, engine_settings(args, on_gpu), gpus)
    rounds = PromptRounds(args)
    prompts = make_prompts(model_dir, rounds.total, args.prompt_tokens)
    name = args.preset or os.path.basename(model_dir)
    meta = {"title": f"Served vs direct: {name}, {gpus or 'no'} GPU(s), "
                     f"{args.prompt_tokens} prompt / {args.output_tokens} output tokens",
            "hardware": hardware(), "commit": git_commit(),
            "command": " ".join(["python"] + [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
            "settings": {k: v for k, v in settings.items() if k != "model"},
            "gpus": gpus, "reuse_prompts": args.reuse_prompts, "targets": "c=256: llm >= 90% of direct, llm_bls >= 85%, served TTFT "
                                     "p50 <= 1.2x direct; c=1: ms/token within 3%"}
    rows: list[dict] = []

    def on_row(row: dict) -> None:      # saved as it comes: a run cut off keeps its rounds
        rows.append(row)
        if args.out:
            write_results(args.out, meta, rows, table(rows), echo=False)

    if not args.skip_direct:
        run_direct(args, settings, prompts, rounds, gpus, on_row)
    if not args.skip_served:
        run_served(args, repo, prompts, rounds, gpus, work, on_row)
    if args.out:
        write_results(args.out, meta, rows, table(rows))
    else:
        print("\n".join(table(rows)))
    shutil.rmtree(work, ignore_errors=True)
    return {"meta": meta, "results": rows}


if __name__ == "__main__":
    main()
