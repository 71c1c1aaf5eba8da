#!/usr/bin/env bash
# Makes the `perf_analyzer` that the tritonclient wheel puts in the venv's bin/ runnable.
#
# `ldd` of the binary shows two libraries the loader cannot find:
#   libb64.so.0d     Debian package libb64-0d (apt, when we are root; failing that, the copy
#                    bundled in nvidia-pytriton's nvidia_pytriton.libs, linked under the venv)
#   libcudart.so.12  PyPI nvidia-cuda-runtime-cu12 (requirements.txt), in site-packages/nvidia/
#                    cuda_runtime/lib, which is on no search path
# so the binary moves to bin/perf_analyzer.bin and bin/perf_analyzer becomes a wrapper that puts
# those directories on LD_LIBRARY_PATH (genai-perf finds it on PATH too). Same for perf_client.
# Idempotent: run it again after tritonclient is reinstalled.
#
#     scripts/setup_perf_analyzer.sh [VENV]        (default: .venv)
set -euo pipefail

venv=$(cd "${1:-.venv}" && pwd)
py="$venv/bin/python"
site_packages=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cudart_dir="$site_packages/nvidia/cuda_runtime/lib"
extra_lib_dir="$venv/lib/perf_analyzer"

if [ ! -e "$venv/bin/perf_analyzer" ]; then
    echo "setup_perf_analyzer: $venv/bin/perf_analyzer missing: pip install tritonclient" >&2
    exit 1
fi
if [ ! -e "$cudart_dir/libcudart.so.12" ]; then
    echo "setup_perf_analyzer: $cudart_dir/libcudart.so.12 missing:" \
         "pip install -r requirements.txt (nvidia-cuda-runtime-cu12)" >&2
    exit 1
fi

has_system_libb64() {
    { /sbin/ldconfig -p 2>/dev/null || ldconfig -p 2>/dev/null || true; } | grep -q 'libb64\.so\.0d'
}

if ! has_system_libb64 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt_install="apt-get install -y -q --no-install-recommends libb64-0d"
    # A fresh image may have empty package lists: update only when the first try fails.
    $apt_install >/dev/null 2>&1 || { apt-get update -q >/dev/null && $apt_install >/dev/null; } \
        || echo "setup_perf_analyzer: apt-get could not install libb64-0d" >&2
fi
if ! has_system_libb64 && [ ! -e "$extra_lib_dir/libb64.so.0d" ]; then
    # Not root, no apt, or apt failed: use the libb64 that nvidia-pytriton bundles (the same
    # library, renamed by auditwheel).
    bundled=$(ls "$site_packages"/nvidia_pytriton.libs/libb64-*.so.0d 2>/dev/null | head -n 1)
    if [ -z "$bundled" ]; then
        echo "setup_perf_analyzer: libb64.so.0d not found; install Debian's libb64-0d" >&2
        exit 1
    fi
    echo "setup_perf_analyzer: using nvidia-pytriton's copy of libb64" >&2
    mkdir -p "$extra_lib_dir"
    ln -sf "$bundled" "$extra_lib_dir/libb64.so.0d"
fi

for tool in perf_analyzer perf_client; do
    wrapper="$venv/bin/$tool"
    [ -e "$wrapper" ] || continue
    # An ELF file here is a fresh binary from the wheel (first run, or tritonclient reinstalled).
    if [ "$(head -c 4 "$wrapper" | tail -c 3)" = "ELF" ]; then
        mv -f "$wrapper" "$wrapper.bin"
    fi
    cat > "$wrapper" <<EOF
#!/usr/bin/env bash
# Written by scripts/setup_perf_analyzer.sh: the real binary is $tool.bin; it needs
# libcudart.so.12 from nvidia-cuda-runtime-cu12 (and libb64.so.0d) on the library path.
LD_LIBRARY_PATH="$cudart_dir:$extra_lib_dir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" \\
    exec -a "\$0" "$wrapper.bin" "\$@"
EOF
    chmod +x "$wrapper"
    missing=$(LD_LIBRARY_PATH="$cudart_dir:$extra_lib_dir" ldd "$wrapper.bin" | grep 'not found' || true)
    if [ -n "$missing" ]; then
        echo "setup_perf_analyzer: $tool still misses libraries:" >&2
        echo "$missing" >&2
        exit 1
    fi
done
echo "perf_analyzer ready: $venv/bin/perf_analyzer"
