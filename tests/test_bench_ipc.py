"""scripts/bench_ipc.py at a tiny size: it runs, writes its results, and the steady-state
core -> front end frame stays within the issue's 16 bytes per running request per step."""
import json

from scripts.bench_ipc import TARGET_BYTES_PER_REQUEST, main


def test_bench_ipc_writes_results_and_meets_target(tmp_path):
    main(["--num-running", "1,8", "--steps", "5", "--prompt-len", "20", "--block-size", "4",
          "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "ipc.json").read_text())
    assert (tmp_path / "ipc.md").read_text().startswith("# IPC bytes")
    for key in ("command", "commit", "date", "cpu", "cores", "python", "target"):
        assert key in data["meta"], key
    rows = {(r["num_running"], r["direction"]): r for r in data["results"]}
    assert set(rows) == {(n, d) for n in (1, 8)
                         for d in ("frontend_to_core", "core_to_frontend", "core_to_runner")}
    for n in (1, 8):
        assert rows[n, "frontend_to_core"]["wire_bytes_per_step_mean"] == 0
        out = rows[n, "core_to_frontend"]
        # Rows known from the previous frame: header 7 + (n_rows, flags) 5 + a token each.
        assert out["steps_with_rows_sent"] == 0
        assert out["wire_bytes_per_step_max"] == 12 + 4 * n
        assert out["wire_bytes_per_request_per_step"] <= TARGET_BYTES_PER_REQUEST
        assert out["wire_bytes_per_request_per_step"] < out["pickle_bytes_per_request_per_step"]
        sched = rows[n, "core_to_runner"]
        assert sched["wire_bytes_per_step_mean"] < sched["pickle_bytes_per_step_mean"]
        for r in (out, sched):
            for key in ("wire_encode_us", "wire_decode_us", "pickle_encode_us",
                        "pickle_decode_us", "wire_round_trip_us", "pickle_round_trip_us"):
                assert 0 < r[key]["median"] <= r[key]["p99"], key
