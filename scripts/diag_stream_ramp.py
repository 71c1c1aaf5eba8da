"""Diagnosis (not a benchmark): why perf_analyzer --streaming keeps fewer requests in flight on
the GPU than it is asked to. Starts tritonserver like bench_serving (8B shape, dummy weights),
then runs perf_analyzer variants and records, per run, requests in flight over time (from its
profile export), TTFT, and Triton's per-execute cost of the llm model.

    python scripts/diag_stream_ramp.py --out DIR [--py-spy]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from types import SimpleNamespace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from scripts.bench_common import preset_dir, process_cmdlines  # noqa: E402
from scripts.bench_serving import engine_settings, make_repository  # noqa: E402
from scripts.serving_workload import make_prompts  # noqa: E402
from scripts.serving_clients import perf_analyzer_path, write_input_data  # noqa: E402


def triton_metrics(url: str) -> dict:
    txt = urllib.request.urlopen(f"http://{url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in txt.splitlines():
        if line.startswith("nv_inference"):
            model = line.split('model="', 1)[1].split('"', 1)[0]
            key = f"{line.split('{')[0].replace('nv_inference_', '')}:{model}"
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def stub_pid(model: str) -> int | None:
    return next((pid for pid, cmd in process_cmdlines()
                 if "triton_python_backend_stub" in cmd and f"/{model}/1/model.py" in cmd), None)


def run_pa(server, work, prompts, model, c, n, procs, env_extra, extra_args=(), host="localhost"):
    stream = model == "llm"
    url = f"{host}:{server.grpc_port}"
    handles, exports = [], []
    env = dict(os.environ, **env_extra)
    m0 = triton_metrics(server.metrics_url)
    t_launch = time.time()
    for k in range(procs):
        ck, nk = c // procs + (k < c % procs), n // procs + (k < n % procs)
        data = os.path.join(work, f"in-{model}-{k}.json")
        write_input_data(data, prompts[k:n:procs], 128, stream)
        exports.append(os.path.join(work, f"exp-{model}-{k}.json"))
        cmd = [perf_analyzer_path(), "-m", model, "-i", "grpc", "-u", url,
               "--input-data", data, "--concurrency-range", str(ck), "--request-count", str(nk),
               "--max-threads", str(ck), "--profile-export-file", exports[-1], *extra_args]
        if stream:
            cmd.append("--streaming")
        handles.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=env))
    reqs = []
    for h, e in zip(handles, exports):
        out, _ = h.communicate(timeout=600)
        if h.returncode:
            raise RuntimeError(out[:1500])
        with open(e) as f:
            exp = json.load(f)
        os.remove(e)            # perf_analyzer refuses to write over an export
        reqs += [r for x in exp["experiments"] for r in x["requests"] if r["response_timestamps"]]
    m1 = triton_metrics(server.metrics_url)
    s = np.array([r["timestamp"] for r in reqs]) / 1e6
    f = np.array([r["response_timestamps"][0] for r in reqs]) / 1e6
    last = np.array([r["response_timestamps"][-1] for r in reqs]) / 1e6
    t0 = s.min()
    s, f, last = s - t0, f - t0, last - t0
    grid = np.arange(0, last.max(), 100.0)
    d = {k: m1[k] - m0.get(k, 0.0) for k in m1}
    execs = d.get("exec_count:llm", 0) or 1
    return {
        "model": model, "c": c, "n": n, "procs": procs, "env": env_extra, "url": url,
        "first_send_after_launch_ms": round(1e3 * (t0 / 1e3 - t_launch), 1),
        "span_ms": round(float(last.max()), 1),
        "output_tok_s": round(len(reqs) * 128 / last.max() * 1e3, 1),
        "in_flight_per_100ms": [int(((s <= x) & (last > x)).sum()) for x in grid],
        "sends_per_100ms": np.histogram(s, np.append(grid, grid[-1] + 100))[0].tolist(),
        "ttft_p50_ms": round(float(np.percentile(f - s, 50)), 1),
        "ttft_p90_ms": round(float(np.percentile(f - s, 90)), 1),
        "responses_per_request": round(float(np.mean([len(r["response_timestamps"])
                                                      for r in reqs])), 2),
        "llm_execs": d.get("exec_count:llm"),
        "llm_compute_infer_us_per_exec": round(d.get("compute_infer_duration_us:llm", 0) / execs, 1),
        "llm_queue_us_per_request": round(d.get("queue_duration_us:llm", 0) /
                                          max(d.get("request_success:llm", 1), 1), 1),
        "bls_queue_us_per_request": round(d.get("queue_duration_us:llm_bls", 0) /
                                          max(d.get("request_success:llm_bls", 1), 1), 1),
    }


def resolver_probe(port: int) -> dict:
    """How long name resolution and a gRPC connection take for 'localhost' vs '127.0.0.1'."""
    import socket
    import grpc
    out = {}
    for name in ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf"):
        try:
            with open(name) as f:
                out[name] = f.read()[-400:]
        except OSError as e:
            out[name] = str(e)
    for host in ("localhost", "127.0.0.1"):
        t = time.perf_counter()
        socket.getaddrinfo(host, port)
        out[f"getaddrinfo {host} ms"] = round(1e3 * (time.perf_counter() - t), 2)
        for resolver in ("", "native"):
            env_before = os.environ.get("GRPC_DNS_RESOLVER")
            t = time.perf_counter()
            ch = grpc.insecure_channel(f"{host}:{port}")
            try:
                grpc.channel_ready_future(ch).result(timeout=20)
                out[f"grpc ready {host} ms"] = round(1e3 * (time.perf_counter() - t), 2)
            except Exception as e:  # noqa: BLE001
                out[f"grpc ready {host} ms"] = repr(e)
            ch.close()
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--py-spy", action="store_true")
    ap.add_argument("--runs", nargs="+", default=["warm", "ip", "ip_bls"])
    ap.add_argument("--configs", nargs="+", default=["base:"],
                    help="NAME:KEY=VALUE,KEY=VALUE ... one server each, engine settings")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from tests.tritonserver import start_server
    model_dir = preset_dir("llama-3.1-8b", tokenizer=True)
    runs = {
        "warm": ("llm", 256, 1024, 4, {}),
        "base": ("llm", 256, 1024, 4, {}),
        "novis": ("llm", 256, 1024, 4, {"CUDA_VISIBLE_DEVICES": ""}),
        "ip": ("llm", 256, 1024, 4, {}, (), "127.0.0.1"),
        "ip_bls": ("llm_bls", 256, 1024, 4, {}, (), "127.0.0.1"),
        "proc1_64": ("llm", 64, 256, 1, {}),
        "bls": ("llm_bls", 256, 1024, 4, {}),
    }
    results = []
    for config in args.configs:
        cname, _, sets = config.partition(":")
        ns = SimpleNamespace(concurrency=[256], prompt_tokens=215, output_tokens=128,
                             shared_prefix_tokens=0, preset="llama-3.1-8b",
                             set=[x for x in sets.split(",") if x])
        work = tempfile.mkdtemp(prefix="diag-")
        repo = os.path.join(work, "repo")
        make_repository(repo, model_dir, engine_settings(ns, True), 1)
        prompts = make_prompts(model_dir, 1024, 215)
        t0 = time.time()
        with start_server(repo, timeout_s=900, log_dir=work) as server:
            print(f"[{cname}] server ready after {time.time() - t0:.1f} s", flush=True)
            if not results:
                probe = resolver_probe(server.grpc_port)
                print(json.dumps(probe), flush=True)
                with open(os.path.join(args.out, "resolver.json"), "w") as f:
                    json.dump(probe, f, indent=1)
            for name in args.runs:
                spy = None
                if args.py_spy and name == "ip":
                    pid = stub_pid("llm")
                    spy = subprocess.Popen(
                        ["py-spy", "record", "-p", str(pid), "-d", "6", "-r", "200", "--gil",
                         "--threads", "-f", "raw", "-o",
                         os.path.join(args.out, f"stub_gil_{cname}.txt")],
                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                t_run = time.time()
                r = run_pa(server, work, prompts, *runs[name])
                r["wall_s"] = round(time.time() - t_run, 1)
                r["name"], r["config"] = name, cname
                if spy is not None:
                    spy.wait(timeout=60)
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if "per_100ms" not in k}),
                      flush=True)
                print("  in flight /100ms:", r["in_flight_per_100ms"][:60], flush=True)
                with open(os.path.join(args.out, "diag.json"), "w") as f:
                    json.dump(results, f, indent=1)
            with open(server.log_path) as f:
                tail = f.read()[-3000:]
        with open(os.path.join(args.out, f"server_{cname}.log"), "w") as f:
            f.write(tail)


if __name__ == "__main__":
    main()
