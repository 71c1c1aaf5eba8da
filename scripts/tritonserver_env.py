"""Runs the real `tritonserver` that ships inside the `nvidia-pytriton` wheel.

The wheel carries the server binary, the Python backend and one backend stub per Python
version. We copy the backend into `.triton/backends/python` with the stub for the running
interpreter beside `libtriton_python.so`, and point the loader at the wheel's bundled
libraries and this interpreter's libpython.

    python scripts/tritonserver_env.py [--http-port 8000] [--grpc-port 8001]
        [--metrics-port 8002] [--model-repository model_repository] [extra tritonserver args]

Before it starts the server it removes the Python backend's shared-memory regions in /dev/shm
that no live process has open or maps: what servers killed with SIGKILL (or whose stubs were)
left behind.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import site
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from engine.instance_board import pid_namespace  # noqa: E402 (the boards' key, the regions' too)

BACKEND_DIR = os.path.join(ROOT, ".triton", "backends")
PYTHON_THREAD_POOL_SIZE = 64


def _pytriton_dir() -> str:
    for sp in site.getsitepackages() + [site.getusersitepackages()]:
        d = os.path.join(sp, "pytriton", "tritonserver")
        if os.path.isdir(d):
            return d
    raise FileNotFoundError("tritonserver not found: install it with "
                            "`pip install --no-deps nvidia-pytriton==0.7.0`")


def server_binary() -> str:
    return os.path.join(_pytriton_dir(), "bin", "tritonserver")


def prepare_backend_dir() -> str:
    """Makes `.triton/backends/python` with the stub for this Python; returns the backends dir.

    The copy is remade when what it was made from changes (another Python, another wheel; not
    merely another venv with the same wheel), and swapped in by rename, so that concurrent
    callers (tests, `make serve`) never see half a copy.
    """
    src = _pytriton_dir()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = os.path.join(src, "python_backend_stubs", version, "triton_python_backend_stub")
    if not os.path.exists(stub):
        raise FileNotFoundError(f"the wheel has no Python backend stub for Python {version}")
    dst = os.path.join(BACKEND_DIR, "python")
    marker = os.path.join(dst, ".source")
    lib = os.path.join(src, "backends", "python", "libtriton_python.so")
    source = f"python {version} stub {_sha256(stub)} backend {_sha256(lib)}"
    if _read(marker) == source:
        return BACKEND_DIR
    os.makedirs(BACKEND_DIR, exist_ok=True)
    gitignore = os.path.join(os.path.dirname(BACKEND_DIR), ".gitignore")
    if not os.path.exists(gitignore):
        with open(gitignore, "w") as f:
            f.write("# made by scripts/tritonserver_env.py\n*\n")
    tmp = tempfile.mkdtemp(prefix=".python-", dir=BACKEND_DIR)
    shutil.copytree(os.path.join(src, "backends", "python"), tmp, dirs_exist_ok=True)
    shutil.copy2(stub, os.path.join(tmp, "triton_python_backend_stub"))
    with open(os.path.join(tmp, ".source"), "w") as f:
        f.write(source)
    old = tmp + ".old"
    try:
        os.rename(dst, old)
    except FileNotFoundError:
        pass
    try:
        os.rename(tmp, dst)
    except OSError:  # another process put its copy there first: keep that one
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return BACKEND_DIR


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def server_env(base: dict | None = None) -> dict:
    """Environment for tritonserver and its Python stubs (which import our engine)."""
    env = dict(os.environ if base is None else base)
    src = _pytriton_dir()
    site_packages = os.path.dirname(os.path.dirname(src))
    libs = [os.path.join(site_packages, "nvidia_pytriton.libs"),
            sysconfig.get_config_var("LIBDIR") or ""]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [p for p in libs if p] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    # The backend stub embeds Python in isolated mode (PYTHONPATH is ignored) and takes its
    # sys.executable from the first `python3` on PATH; Python then finds the virtualenv's
    # pyvenv.cfg beside it, so the stub sees this environment's packages (its numpy, torch).
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, site_packages] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def space_free(path: str, kind: str) -> str:
    """`path`, or where it holds whitespace, a link to it without any: Triton 2.51's Python
    backend starts each stub through `bash -c` with the backend's and the model's paths
    unquoted, so from a checkout or repository under "My Projects" no model ever loads. The
    links live in the temporary directory, one per path (named by its hash), remade if they
    point elsewhere."""
    if not any(c.isspace() for c in path):
        return path
    path = os.path.abspath(path)
    links = os.path.join(tempfile.gettempdir(), f"tritonllm-links-{os.getuid()}")
    if any(c.isspace() for c in links):
        raise ValueError(f"{kind} {path!r} holds whitespace, which Triton's Python backend "
                         f"cannot start stubs from, and so does the temporary directory "
                         f"{links!r} where a link to it would go: move one of them")
    os.makedirs(links, exist_ok=True)
    link = os.path.join(links, f"{kind}-{hashlib.sha256(path.encode()).hexdigest()[:16]}")
    if os.path.islink(link) and os.readlink(link) == path:
        return link
    tmp = tempfile.mktemp(prefix=".link-", dir=links)
    os.symlink(path, tmp)
    os.replace(tmp, link)           # atomic: a concurrent caller sees one link or the other
    return link


def model_control(extra: list[str]) -> list[str]:
    """Explicit model control, loading every model at start: the same models as the default
    mode, and `llm` can unload itself when its engine dies, which turns its readiness false
    (the only way to in this Triton version). Where the caller's flags choose a mode or the
    models to load, theirs stand (tritonserver refuses `--load-model=*` beside another
    `--load-model`, and `--load-model` without the explicit mode)."""
    mode = any(a.startswith("--model-control-mode") for a in extra)
    load = any(a.startswith("--load-model") for a in extra)
    if mode:
        return [] if load else (["--load-model=*"] if _explicit(extra) else [])
    return ["--model-control-mode=explicit"] + ([] if load else ["--load-model=*"])


def _explicit(extra: list[str]) -> bool:
    """Whether the last --model-control-mode in `extra` (`=value` or a separate value) is
    explicit."""
    value = None
    for i, a in enumerate(extra):
        if a.startswith("--model-control-mode="):
            value = a.split("=", 1)[1]
        elif a == "--model-control-mode" and i + 1 < len(extra):
            value = extra[i + 1]
    return value == "explicit"


def check_model_names(model_repository: str) -> None:
    """Triton 2.51's Python backend starts a model's stub through `bash -c` with its path
    unquoted (as for the repository's, space_free): a model folder named with whitespace
    ("llm copy", a file manager's copy) never loads, and the server waits for it for ever."""
    try:
        names = sorted(n for n in os.listdir(model_repository)
                       if os.path.isdir(os.path.join(model_repository, n)))
    except OSError:
        return                          # tritonserver says what is wrong with the repository
    bad = [n for n in names if any(c.isspace() for c in n)]
    if bad:
        raise ValueError(f"model folder(s) {bad} in {model_repository} hold whitespace, which "
                         f"Triton's Python backend cannot start a model from (the server would "
                         f"wait for it for ever): rename them")


def server_command(model_repository: str, http_port: int, grpc_port: int, metrics_port: int,
                   extra: list[str] | None = None) -> list[str]:
    extra = list(extra or [])
    check_model_names(model_repository)
    return [server_binary(),
            f"--model-repository={space_free(model_repository, 'repository')}",
            f"--backend-directory={space_free(prepare_backend_dir(), 'backends')}",
            f"--http-port={http_port}", f"--grpc-port={grpc_port}",
            f"--metrics-port={metrics_port}", "--allow-metrics=true",
            *model_control(extra),
            # Server threads per Python model instance for BLS calls (32 by default): llm_bls
            # keeps up to this many - 1 requests of an instance in llm (its config.pbtxt).
            # `extra` may give another: the last one counts.
            f"--backend-config=python,thread-pool-size={PYTHON_THREAD_POOL_SIZE}",
            f"--backend-config=python,shm-region-prefix-name={SHM_PREFIX}",
            "--log-info=true"] + extra


_PARAM = re.compile(r'^parameters \{ key: "([^"]+)" value: \{ string_value: "([^"]*)" \} \}$\n?',
                    re.M)


def copy_repository(dst: str | os.PathLike, model_dir: str | os.PathLike,
                    llm_params: dict, keep_params: bool = True) -> dict[str, str]:
    """A copy of this project's model_repository whose llm has `model` (made absolute) and
    `llm_params` set over its own parameters (or, keep_params=False, instead of them);
    returns the llm's parameters."""
    shutil.copytree(os.path.join(ROOT, "model_repository"), dst, dirs_exist_ok=True)
    cfg_path = os.path.join(dst, "llm", "config.pbtxt")
    with open(cfg_path) as f:
        cfg = f.read()
    params = {**(dict(_PARAM.findall(cfg)) if keep_params else {}),
              "model": os.path.abspath(model_dir), **{k: str(v) for k, v in llm_params.items()}}
    cfg = _PARAM.sub("", cfg) + "".join(
        f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
        for k, v in params.items())
    with open(cfg_path, "w") as f:
        f.write(cfg)
    return params


# The Python backend's shared-memory regions, one per model instance (~1.6 MB each). A server
# that stops cleanly removes its own; one that was killed (or whose stub was) leaves them, and
# on a small /dev/shm (Docker's default is 64 MB) they pile up until a server cannot start.
# Their names carry this pid namespace (the backend's shm-region-prefix-name, server_command):
# whether a region is in use is told from this namespace's /proc, which does not show the
# processes of a server in another container sharing /dev/shm (docker --ipc=host), so only
# this namespace's regions are ever judged.
SHM_DIR = "/dev/shm"


SHM_PREFIX = f"triton_python_backend_shm_region_ns{pid_namespace()}_"


def shm_regions() -> set[str]:
    """The names of the Python backend's shared-memory regions now in /dev/shm."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:           # no /dev/shm (not Linux): nothing to clean
        return set()


def shm_names_in_use() -> set[str]:
    """The /dev/shm names some live process has open or maps (of the processes this user can
    read). Per process its open files are read before its maps: a region being made is open
    from its creation until it is mapped, so one of the two shows it."""
    prefix = SHM_DIR + "/"
    names = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(prefix):
                    names.add(target[len(prefix):].split()[0])
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(prefix)
                    if at >= 0:
                        names.add(line[at + len(prefix):].split()[0])
        except OSError:                 # gone meanwhile, or not ours to read
            continue
    return names


def remove_orphan_regions(candidates: set[str]) -> list[str]:
    """Removes those of `candidates` that are this user's and no live process has open or
    maps; returns them. Another user's processes cannot be read, so their regions would look
    orphaned (and cannot be removed: /dev/shm is sticky)."""
    if not candidates:
        return []
    removed = []
    for name in sorted(candidates - shm_names_in_use()):
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != os.geteuid():
                continue
            os.unlink(path)
        except OSError:                  # gone meanwhile, or not ours to remove
            continue
        removed.append(name)
    return removed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-repository", default=os.path.join(ROOT, "model_repository"))
    ap.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    ap.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    ap.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    args, extra = ap.parse_known_args()
    cmd = server_command(os.path.abspath(args.model_repository), args.http_port, args.grpc_port,
                         args.metrics_port, extra)
    removed = remove_orphan_regions(shm_regions())
    if removed:
        print(f"removed {len(removed)} shared-memory regions that dead servers left in {SHM_DIR}",
              flush=True)
    print(shlex.join(cmd), flush=True)
    os.execve(cmd[0], cmd, server_env())


if __name__ == "__main__":
    main()
