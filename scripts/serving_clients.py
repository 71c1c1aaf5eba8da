"""The load generators of scripts/bench_serving.py and the client's figures of a run.

- perf_analyzer (C++, from tritonclient): `clients` processes at once, each with its share of
  the concurrency and of the requests; per request its send and response times come from the
  profile export;
- a closed loop of Python gRPC clients (tritonclient.grpc.aio) in `procs` processes
  (`python scripts/serving_clients.py --py-client-worker SPEC`), one stream per context: a
  second client beside perf_analyzer, to tell the client's gaps from the server's;
- `summarize`: output tok/s over the whole run and at full load, TTFT / ITL quantiles, requests
  in flight and the gaps between a request's end and its slot's next send.
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


def summarize(starts, firsts, lasts, ends, output_tokens: int, concurrency: int = 0,
              clients=None) -> dict:
    """Client-side figures of one run (times in seconds, one entry per request). clients:
    where several load-generator processes share the concurrency, (each request's client
    index, each client's slots) (see full_load_window)."""
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
            **full_load(starts, firsts, lasts, output_tokens, concurrency, clients),
            # requests in flight on average: below the concurrency, the client left gaps
            "mean_in_flight": round(float((ends - starts).sum()) / span, 1),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            **after_first_wave(starts, ttft, concurrency),
            **arrival_spread(starts, concurrency),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            **reissue_gaps(starts, ends, concurrency)}


def after_first_wave(starts, ttft_ms, c: int) -> dict:
    """TTFT of the requests sent after the first c (the closed loop's opening burst, which
    queues for its prefills all at once: ~700 ms at 256 x 215 tokens on the H200, a quarter of a
    4-wave run, direct and served alike). What is left is the steady state's."""
    if c <= 0 or len(starts) <= c:
        return {}
    later = np.asarray(ttft_ms)[np.argsort(starts, kind="stable")[c:]]
    return {"ttft_after_first_wave_p50_ms": round(float(np.percentile(later, 50)), 3),
            "ttft_after_first_wave_p99_ms": round(float(np.percentile(later, 99)), 3)}


ARRIVAL_BIN_S = 0.05


def arrival_spread(starts, c: int) -> dict:
    """How bunched the sends after the first c are (issue 11's TTFT: do the clients' arrival
    patterns differ?): the sends counted per 50 ms, their coefficient of variation and the share
    of them in the busiest fifth of those bins. Evenly spread sends give cv 0 and a share of 0.2."""
    if c <= 0 or len(starts) <= c + 1:
        return {}
    later = np.sort(np.asarray(starts, dtype=np.float64))[c:]
    # + 1e-6 (50 ns): a send on a bin's edge goes into that bin ((0.09 - 0.04) / 0.05 is 0.99999...)
    counts = np.bincount(np.floor((later - later[0]) / ARRIVAL_BIN_S + 1e-6).astype(np.int64))
    busiest = np.sort(counts)[::-1][:max(1, len(counts) // 5)]
    return {"arrivals_cv_50ms": round(float(counts.std() / counts.mean()), 3),
            "arrivals_in_busiest_fifth": round(float(busiest.sum() / counts.sum()), 3)}


def full_load_window(starts, c: int, clients=None) -> tuple[float, float] | None:
    """From the send that filled the last empty slot (every slot filled once) to the last send,
    in the sends' clock (epoch seconds: perf_analyzer's and the python client's); None for a
    run too short to have one. That is the c-th send, unless several load-generator processes
    share c (clients: each request's client index, each client's slots): one that started late
    fills its slots after an early one's re-sends, and one that started early sends its last
    request first, so the window runs from the last of them to fill its slots to the first of
    them to send its last request."""
    if c <= 0 or len(starts) <= c:
        return None
    starts = np.asarray(starts, dtype=np.float64)
    sends = np.sort(starts)
    t0, t1 = float(sends[c - 1]), float(sends[-1])
    if clients is not None:
        index, slots = np.asarray(clients[0]), clients[1]
        for k, ck in enumerate(slots):
            own = np.sort(starts[index == k])
            if len(own) < ck:
                return None
            t0, t1 = max(t0, float(own[ck - 1])), min(t1, float(own[-1]))
    return (t0, t1) if t1 > t0 else None


def full_load(starts, firsts, lasts, output_tokens: int, c: int, clients=None) -> dict:
    """Output tok/s while the client has all its slots in use: from the c-th send (every slot
    filled once) to the last send (after it, slots empty as the run drains). The whole-run
    figure also charges the server with the client's ramp-up (perf_analyzer's processes and
    threads start over seconds) and the drain. A request's tokens are counted where they
    came: the first at its first response, the rest spread evenly to its last response (one
    response: over the time it was out)."""
    window = full_load_window(starts, c, clients)
    if window is None:
        return {}
    t0, t1 = window
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


def request_params(output_tokens: int, sampling: dict | None = None) -> dict:
    """A request's sampling_parameters: exactly output_tokens tokens (ignore_eos), greedy unless
    `sampling` (SamplingParams fields) says otherwise; max_tokens and ignore_eos are the run's
    whatever `sampling` says (the results count output_tokens a request)."""
    return {"temperature": 0, **(sampling or {}), "max_tokens": output_tokens, "ignore_eos": True}


def write_input_data(path: str, prompts: list[str], output_tokens: int, stream: bool,
                     sampling: dict | None = None) -> None:
    params = json.dumps(request_params(output_tokens, sampling))
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
                      output_tokens: int, clients: int = 1, sampling: dict | None = None,
                      cpus: set[int] | None = None) -> dict:
    """`clients` perf_analyzer processes at once, c and n shared among them: one process
    handles about 5,000 streamed responses/s (seen on the H200 host: beyond that it lets its
    requests in flight drop), so a fast server needs several to be kept busy. Client k sends
    prompts k, k + clients, ... of the first n: together the n prompts the direct engine and
    the python client send. (Each used to read the whole list from its start: 4 clients sent
    the first quarter 4 times, so a later round with all n prompts found 3/4 of them outside
    the prefix cache, and prefilled them, where the direct engine's steady round did not.)
    `cpus`: the CPUs the clients may run on (bench_serving --client-cpus); None: ours."""
    from tests.tritonserver import on_cpus
    clients = max(1, min(clients, c))
    procs, exports, slots = [], [], []
    for k in range(clients):
        ck, nk = c // clients + (k < c % clients), n // clients + (k < n % clients)
        slots.append(ck)
        data = os.path.join(work, f"input-{model}-{c}-{k}.json")
        write_input_data(data, client_prompts(prompts, n, clients)[k], output_tokens,
                         stream=model == "llm", sampling=sampling)
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
                                      text=True, preexec_fn=on_cpus(cpus)))
    reqs, index = [], []
    for k, (proc, export) in enumerate(zip(procs, exports)):
        out, _ = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"perf_analyzer failed ({proc.returncode}):\n{out[-3000:]}")
        try:
            with open(export) as f:
                exp = json.load(f)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"perf_analyzer wrote no profile export ({e}):\n{out[-3000:]}")
        os.remove(export)
        own = [r for e in exp["experiments"] for r in e["requests"] if r["response_timestamps"]]
        reqs += own
        index += [k] * len(own)
    starts = [r["timestamp"] / 1e9 for r in reqs]
    firsts = [r["response_timestamps"][0] / 1e9 for r in reqs]
    lasts = [r["response_timestamps"][-1] / 1e9 for r in reqs]
    out = summarize(starts, firsts, lasts, lasts, output_tokens, c, (index, slots))
    out["responses_per_request"] = round(
        sum(len(r["response_timestamps"]) for r in reqs) / max(len(reqs), 1), 2)
    out["clients"] = clients
    out["full_load_window"] = full_load_window(starts, c, (index, slots))
    return out


def py_client_worker(spec: dict) -> None:
    """A closed loop of Python gRPC clients (tritonclient.grpc.aio), one stream per context: a
    second client beside perf_analyzer, to tell the client's gaps from the server's. Reads
    "go" on stdin once connected; prints a JSON list of per-request (send, first, last)."""
    import tritonclient.grpc.aio as grpcclient
    import tritonclient.grpc as grpcsync
    model, stream_mode = spec["model"], spec["model"] == "llm"
    params = json.dumps(request_params(spec["output_tokens"], spec.get("sampling")))

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
                reason = result.as_numpy("finish_reason")     # "None" until the last response
                if reason is not None and reason[0] != b"None":
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
                  procs: int, sampling: dict | None = None, cpus: set[int] | None = None) -> dict:
    """`procs` processes of py_client_worker share c and n (on `cpus`: see run_perf_analyzer)."""
    from tests.tritonserver import on_cpus
    procs = max(1, min(procs, c))
    workers, first, slots = [], 0, []
    for k in range(procs):
        ck, nk = c // procs + (k < c % procs), n // procs + (k < n % procs)
        slots.append(ck)
        spec_path = tempfile.mkstemp(prefix="bench-pyclient-", suffix=".json")[1]
        with open(spec_path, "w") as f:
            json.dump({"url": grpc_address(server), "model": model, "c": ck, "n": nk, "first": first,
                       "prompts": prompts, "output_tokens": output_tokens, "sampling": sampling}, f)
        first += nk
        workers.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--py-client-worker", spec_path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
            preexec_fn=on_cpus(cpus)))
    for w in workers:
        if w.stdout.readline().strip() != "ready":
            raise RuntimeError("python client did not start")
    for w in workers:
        w.stdin.write("go\n")
        w.stdin.flush()
    times, index = [], []
    for k, w in enumerate(workers):
        out, _ = w.communicate(timeout=3600)
        if w.returncode != 0:
            raise RuntimeError(f"python client failed ({w.returncode})")
        own = json.loads(out.strip().splitlines()[-1])
        times += own
        index += [k] * len(own)
    starts, firsts, lasts = zip(*times)
    out = summarize(starts, firsts, lasts, lasts, output_tokens, c, (index, slots))
    out["clients"] = procs
    out["full_load_window"] = full_load_window(starts, c, (index, slots))
    return out



def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--py-client-worker", required=True, metavar="SPEC",
                    help="run one python client process (a JSON spec written by run_py_client)")
    args = ap.parse_args(argv)
    with open(args.py_client_worker) as f:
        py_client_worker(json.load(f))


if __name__ == "__main__":
    main()
