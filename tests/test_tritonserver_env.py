"""The real tritonserver from scripts/tritonserver_env.py, driven through tests/tritonserver.py.

Probe models are written into tmp dirs: `echo` (plain, STRING in -> STRING out) and
`stream_echo` (decoupled, with the `llm` model's tensor names: it streams the prompt's words,
at most `max_tokens` of them), so these tests do not depend on the engine.
"""
from __future__ import annotations

import json
import mmap
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from scripts.tritonserver_env import (SHM_DIR, SHM_PREFIX, remove_orphan_regions, server_command,
                                      shm_regions)
from tests import tritonserver
from tests.tritonserver import start_server

ROOT = pathlib.Path(__file__).resolve().parent.parent
PERF_ANALYZER = os.path.join(os.path.dirname(sys.executable), "perf_analyzer")

ECHO_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
ECHO_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            out = np.array([b"echo: " + text.reshape(-1)[0]], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", out)]))
        return responses
"""
STREAM_ECHO_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "sampling_parameters" data_type: TYPE_STRING dims: [ 1 ] optional: true },
  { name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "return_finish_reason" data_type: TYPE_BOOL dims: [ 1 ] optional: true }
]
output [
  { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "finish_reason" data_type: TYPE_STRING dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
STREAM_ECHO_MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0]

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            words = _scalar(request, "text_input", b"").decode().split()
            params = json.loads(_scalar(request, "sampling_parameters", b"{}"))
            max_tokens = int(params.get("max_tokens", 16))
            tokens = [w + " " for w in words[:max_tokens]] or [""]
            finish = "length" if len(words) > max_tokens else "stop"
            for i, token in enumerate(tokens):
                outs = [pb_utils.Tensor("text_output", np.array([token.encode()], dtype=object))]
                last = i == len(tokens) - 1
                if last and _scalar(request, "return_finish_reason", False):
                    outs.append(pb_utils.Tensor("finish_reason",
                                                np.array([finish.encode()], dtype=object)))
                sender.send(pb_utils.InferenceResponse(outs), flags=FINAL if last else 0)
        return None
"""
BROKEN_MODEL = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("probe model refuses to load: 7f3a")
"""
# A stub that cannot exit by itself: its finalize holds the GIL (libc sleep called through
# ctypes.PyDLL, which keeps the GIL), so the server waits on it after SIGTERM, and the stub's
# own exit on seeing the server gone would block on the GIL too.
STUCK_MODEL = ECHO_MODEL + """
    def finalize(self):
        import ctypes
        ctypes.PyDLL(None).sleep(600)
"""

# A model that starts a process of its own, in a session of its own, as `llm` starts the
# engine's; this one never exits by itself.
LONG_LIVED_CHILD = "long-lived-child-of-a-stub"
STARTS_A_CHILD_MODEL = ECHO_MODEL + f"""
    def initialize(self, args):
        import subprocess, sys
        self.child = subprocess.Popen(
            [sys.executable, "-c", "import threading; threading.Event().wait()",
             "{LONG_LIVED_CHILD}"], start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""


def write_model(repo: pathlib.Path, name: str, config: str, model_py: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(textwrap.dedent(config))
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(model_py))


def stub_pids(repo: pathlib.Path) -> list[int]:
    """Live Python backend stubs serving models of `repo` (argv: stub, model.py path, ...)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (FileNotFoundError, NotADirectoryError, ProcessLookupError, PermissionError):
            continue
        if (len(argv) > 1 and argv[0].endswith(b"triton_python_backend_stub")
                and argv[1].startswith(bytes(repo) + b"/") and pid_alive(int(entry))):
            pids.append(int(entry))
    return pids


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def echo_repo(tmp_path_factory) -> pathlib.Path:
    repo = tmp_path_factory.mktemp("echo_repo")
    write_model(repo, "echo", ECHO_CONFIG, ECHO_MODEL)
    write_model(repo, "stream_echo", STREAM_ECHO_CONFIG, STREAM_ECHO_MODEL)
    return repo


@pytest.fixture(scope="module")
def server(echo_repo, tmp_path_factory):
    with start_server(echo_repo, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def test_server_starts_on_free_ports_and_is_ready(server):
    ports = {server.http_url, server.grpc_url, server.metrics_url}
    assert len(ports) == 3 and all(url.startswith("localhost:") for url in ports)
    assert httpclient.InferenceServerClient(server.http_url).is_server_ready()
    assert grpcclient.InferenceServerClient(server.grpc_url).is_model_ready("stream_echo")
    assert "Started GRPCInferenceService" in server.log_tail(200)


def test_http_inference(server):
    client = httpclient.InferenceServerClient(server.http_url)
    text = httpclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"over http"], dtype=object))
    result = client.infer("echo", [text])
    assert result.as_numpy("text_output").tolist() == [b"echo: over http"]


def test_grpc_inference(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"over grpc"], dtype=object))
    result = client.infer("echo", [text])
    assert result.as_numpy("text_output").tolist() == [b"echo: over grpc"]


def _run_perf_analyzer(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([PERF_ANALYZER, *args], capture_output=True, text=True, timeout=120)


def test_perf_analyzer_non_streaming(server):
    out = _run_perf_analyzer(["-m", "echo", "-u", server.http_url, "-i", "http",
                              "--concurrency-range", "1", "--request-count", "50"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Throughput:" in out.stdout


def test_perf_analyzer_streaming_with_shipped_input_file(server):
    """scripts/perf_input.json (the README's load test input) is valid for the llm contract."""
    inputs = json.loads((ROOT / "scripts" / "perf_input.json").read_text())
    assert set(inputs["data"][0]) >= {"text_input", "stream", "sampling_parameters"}
    out = _run_perf_analyzer(["-m", "stream_echo", "-u", server.grpc_url, "-i", "grpc",
                              "--streaming", "--input-data", str(ROOT / "scripts/perf_input.json"),
                              "--concurrency-range", "1", "--request-count", "50"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Throughput:" in out.stdout


def test_stop_leaves_no_process_even_when_the_body_fails(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "echo", ECHO_CONFIG, ECHO_MODEL)
    with pytest.raises(ZeroDivisionError):
        with start_server(repo, log_dir=tmp_path) as s:
            stubs = stub_pids(repo)
            assert stubs, "the echo model should run in a triton_python_backend_stub"
            assert set(stubs) <= set(s.group_pids())
            1 / 0
    assert not pid_alive(s.pid)
    assert s.group_pids() == []
    assert stub_pids(repo) == [] and not any(pid_alive(p) for p in stubs)
    assert s.returncode() == 0  # SIGTERM was enough: a graceful shutdown


def test_stop_kills_the_group_when_the_server_hangs(tmp_path):
    """A stub stuck in finalize keeps the server from exiting on SIGTERM; after the grace
    period stop() must SIGKILL the server and the stub, not orphan the stub."""
    repo = tmp_path / "repo"
    write_model(repo, "stuck", ECHO_CONFIG, STUCK_MODEL)
    s = start_server(repo, log_dir=tmp_path)
    stubs = stub_pids(repo)
    assert stubs
    started = time.monotonic()
    s.stop(timeout_s=2.0)
    assert time.monotonic() - started < 15
    assert s.returncode() == -9  # it did hang, so it was the SIGKILL that ended it
    assert stub_pids(repo) == [] and not any(pid_alive(p) for p in stubs)
    assert s.group_pids() == []


def test_stop_ends_what_the_server_started_when_the_server_and_its_stubs_died_first(tmp_path):
    """tritonserver 2.51 can die on its own (SIGSEGV, SIGABRT: README); its stubs then exit,
    and what they started (the engine's processes, in sessions of their own) is left to init,
    out of the server's tree. stop() must still wait for it and end what outlives the server:
    here a process that never exits, which it kills, and says so."""
    repo = tmp_path / "repo"
    write_model(repo, "starts_a_child", ECHO_CONFIG, STARTS_A_CHILD_MODEL)
    s = start_server(repo, log_dir=tmp_path)
    child = None
    try:
        child = next(pid for pid, cmd in s.descendant_pids().items() if LONG_LIVED_CHILD in cmd)
        stubs = tritonserver.Processes({pid: "stub" for pid in stub_pids(repo)})
        assert stubs.fds
        os.kill(s.pid, signal.SIGKILL)
        assert s.wait(30) == -signal.SIGKILL
        stubs.kill()                            # (a stub of ours sees its server go, not all)
        assert stubs.wait_gone(30) == {}
        assert pid_alive(child)
        with pytest.raises(RuntimeError, match="outlived the server") as raised:
            s.stop()
        assert str(child) in str(raised.value)
        assert not pid_alive(child)
    finally:
        s.stop()
        if child is not None and pid_alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_process_ended_by_sigterm_stops_its_servers_first(tmp_path):
    """`timeout` SIGTERMs a benchmark; its server, in a session of its own, would outlive it
    (Python's default SIGTERM runs no atexit) and keep the GPU's memory."""
    repo = tmp_path / "repo"
    write_model(repo, "echo", ECHO_CONFIG, ECHO_MODEL)
    # The child waits in short sleeps: Python runs a signal's handler between bytecodes, so a
    # SIGTERM caught after the last check and before a sleep's system call began (the child
    # preempted there, on a loaded CI machine) waits for that sleep to end. One sleep(600) made
    # this test time out once in CI.
    code = ("import sys, time; from tests.tritonserver import start_server;"
            "s = start_server(sys.argv[1], log_dir=sys.argv[2]); print(s.pid, flush=True);\n"
            "while True: time.sleep(0.1)")
    child = subprocess.Popen([sys.executable, "-c", code, str(repo), str(tmp_path)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    server_pid, regions_before = 0, shm_regions()
    try:
        server_pid = int(child.stdout.readline())
        stubs = stub_pids(repo)
        assert pid_alive(server_pid) and stubs
        child.send_signal(signal.SIGTERM)
        assert child.wait(60) == -signal.SIGTERM        # it still ends by the signal
        assert not pid_alive(server_pid)
        assert stub_pids(repo) == [] and not any(pid_alive(p) for p in stubs)
    finally:
        child.kill()
        child.wait()
        if server_pid and pid_alive(server_pid):        # what the test found: not left behind
            os.killpg(server_pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while tritonserver._live_pids_in_group(server_pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            remove_orphan_regions(shm_regions() - regions_before)


def test_broken_repository_fails_fast_with_log_tail(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "broken", ECHO_CONFIG, BROKEN_MODEL)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="probe model refuses to load: 7f3a"):
        start_server(repo, log_dir=tmp_path, timeout_s=60)
    assert time.monotonic() - started < 30
    assert stub_pids(repo) == []


def test_start_retries_when_a_port_is_taken(tmp_path, monkeypatch):
    """A port can be taken between picking it and the server's bind (parallel test runs)."""
    repo = tmp_path / "repo"  # no models: starts and stops in well under a second
    repo.mkdir()
    taken = socket.create_server(("0.0.0.0", 0))
    taken_port = taken.getsockname()[1]
    real_free_ports = tritonserver._free_ports
    calls = []

    def free_ports_first_taken(count):
        calls.append(count)
        ports = real_free_ports(count)
        return [taken_port] + ports[1:] if len(calls) == 1 else ports

    monkeypatch.setattr(tritonserver, "_free_ports", free_ports_first_taken)
    with taken, start_server(repo, log_dir=tmp_path) as s:
        assert len(calls) == 2
        assert s.http_url != f"localhost:{taken_port}" and s.is_ready()
    logs = sorted(tmp_path.glob("tritonserver-*.log"))
    assert len(logs) == 2
    assert any("already in use" in log.read_text() for log in logs)


def test_orphan_regions_are_removed_and_regions_in_use_kept():
    tag = uuid.uuid4().hex
    names = {kind: f"{SHM_PREFIX}test_{tag}_{kind}" for kind in ("orphan", "open", "mapped")}
    paths = {kind: os.path.join(SHM_DIR, name) for kind, name in names.items()}
    for path in paths.values():
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    held = open(paths["open"], "rb")                     # open, as a region being made is
    with open(paths["mapped"], "r+b") as f:             # mapped, its file closed, as in a stub
        mapped = mmap.mmap(f.fileno(), 4096)
    try:
        assert set(names.values()) <= shm_regions()
        removed = remove_orphan_regions(set(names.values()))
        assert removed == [names["orphan"]]
        assert not os.path.exists(paths["orphan"])
        assert os.path.exists(paths["open"]) and os.path.exists(paths["mapped"])
    finally:
        held.close()
        mapped.close()
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)


def test_only_this_users_regions_of_this_pid_namespace_are_judged():
    """Another user's processes cannot be read, so its regions looked orphaned, and unlinking
    one in the sticky /dev/shm raised PermissionError before the server started; and a region
    of a server in another container sharing /dev/shm (its processes not in this /proc) was
    removed while in use. Now the servers' regions carry this pid namespace in their names
    (server_command), and only this user's are removed."""
    ns = os.stat("/proc/self/ns/pid").st_ino
    assert SHM_PREFIX.endswith(f"_ns{ns}_")
    assert f"--backend-config=python,shm-region-prefix-name={SHM_PREFIX}" in \
        server_command("repo", 1, 2, 3)
    other_ns = os.path.join(SHM_DIR, f"triton_python_backend_shm_region_ns{ns + 1}_"
                                     f"test_{uuid.uuid4().hex}")
    theirs = os.path.join(SHM_DIR, f"{SHM_PREFIX}test_{uuid.uuid4().hex}_theirs")
    try:
        for path in (other_ns, theirs):
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
        assert os.path.basename(other_ns) not in shm_regions()
        if os.geteuid() != 0:
            pytest.skip("making a region another user's (chown) needs root")
        os.chown(theirs, 65534, 65534)
        assert remove_orphan_regions({os.path.basename(theirs)}) == []
        assert os.path.exists(theirs)
    finally:
        for path in (other_ns, theirs):
            if os.path.exists(path):
                os.unlink(path)


def test_serving_entry_point_removes_orphan_regions_before_it_starts_the_server(tmp_path):
    # The entry point execs tritonserver: give it a repository that fails at once.
    path = os.path.join(SHM_DIR, f"{SHM_PREFIX}test_{uuid.uuid4().hex}_left")
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        out = subprocess.run([sys.executable, "scripts/tritonserver_env.py", "--model-repository",
                              str(tmp_path / "none"), "--http-port", "0", "--grpc-port", "0",
                              "--metrics-port", "0"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert "shared-memory regions that dead servers left" in out.stdout, out.stdout
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_a_checkout_and_a_repository_under_paths_with_spaces_serve(tmp_path, monkeypatch):
    """Triton 2.51's Python backend starts each stub through `bash -c` with the backend's and
    the model's paths unquoted: from "My Projects/..." no model loaded, and the server waited
    for ever. The project's own repository (its llm finds "../models/tiny-llama" beside it) in
    a folder with a space, the backend copied under another: llm answers."""
    import shutil

    from scripts import tritonserver_env
    from scripts.make_tiny_model import make_tiny_model
    home = tmp_path / "My Projects"
    shutil.copytree(ROOT / "model_repository", home / "model_repository")
    make_tiny_model(home / "models" / "tiny-llama", arch="llama", seed=1)
    monkeypatch.setattr(tritonserver_env, "BACKEND_DIR", str(tmp_path / "a checkout" / "backends"))
    with start_server(home / "model_repository", log_dir=tmp_path / "logs", timeout_s=180) as s:
        client = grpcclient.InferenceServerClient(s.grpc_url)
        assert client.is_model_ready("llm") and client.is_model_ready("llm_bls")
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"Hello"], dtype=object))
        params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        params.set_data_from_numpy(np.array([b'{"max_tokens": 4, "temperature": 0}'],
                                            dtype=object))
        result = client.infer("llm_bls", [text, params])
        assert result.as_numpy("text_output").size == 1


def test_space_free_links_paths_with_whitespace_and_leaves_the_rest(tmp_path):
    from scripts.tritonserver_env import space_free
    plain = str(tmp_path / "plain")
    assert space_free(plain, "repository") == plain
    spaced = tmp_path / "with space" / "repo"
    spaced.mkdir(parents=True)
    link = space_free(str(spaced), "repository")
    assert not any(c.isspace() for c in link) and os.path.samefile(link, spaced)
    assert space_free(str(spaced), "repository") == link      # the same link, kept
    other = tmp_path / "with\ttab"
    other.mkdir()
    assert os.path.samefile(space_free(str(other), "repository"), other)


def test_the_callers_model_control_flags_stand(tmp_path):
    """The launcher added `--model-control-mode=explicit --load-model=*` whatever the caller
    gave, and tritonserver refuses `*` beside another --load-model ("must be the ONLY startup
    model"), and --load-model without the explicit mode: neither `make serve` nor the tests
    could load one model alone, or use another mode."""
    from scripts.tritonserver_env import model_control
    assert model_control([]) == ["--model-control-mode=explicit", "--load-model=*"]
    assert model_control(["--load-model=a"]) == ["--model-control-mode=explicit"]
    assert model_control(["--model-control-mode=none"]) == []
    assert model_control(["--model-control-mode", "poll"]) == []
    assert model_control(["--model-control-mode=explicit"]) == ["--load-model=*"]
    assert model_control(["--model-control-mode", "explicit", "--load-model", "a"]) == []
    repo = tmp_path / "repo"
    for name in ("a", "b"):
        write_model(repo, name, ECHO_CONFIG, ECHO_MODEL)
    for extra, loaded in ((["--load-model=a"], {"a": True, "b": False}),
                          (["--model-control-mode=none"], {"a": True, "b": True})):
        with start_server(repo, extra_args=extra, log_dir=tmp_path / "log") as s:
            client = httpclient.InferenceServerClient(s.http_url)
            try:
                assert {n: client.is_model_ready(n) for n in loaded} == loaded, extra
            finally:
                client.close()


def test_a_model_folder_named_with_whitespace_is_refused_naming_it(tmp_path):
    """Triton 2.51's Python backend starts a stub through `bash -c` with the model's path
    unquoted: a folder "llm copy" (a file manager's copy) never loaded and the server waited
    for it for ever, with no error."""
    repo = tmp_path / "repo"
    write_model(repo, "echo copy", ECHO_CONFIG, ECHO_MODEL)
    with pytest.raises(ValueError, match=r"model folder\(s\) \['echo copy'\] in .* hold "
                                         r"whitespace.*rename them"):
        start_server(repo, log_dir=tmp_path / "log")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "tritonserver_env.py"),
                        "--model-repository", str(repo)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "rename them" in r.stderr
