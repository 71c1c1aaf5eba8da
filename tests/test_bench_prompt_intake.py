"""scripts/bench_prompt_intake.py: a small run writes its figures over the shared-prefix
bench's prompts."""
import json
import subprocess
import sys


def test_a_small_run_writes_both_timings(tmp_path):
    out = tmp_path / "intake"
    subprocess.run([sys.executable, "scripts/bench_prompt_intake.py", "--workload", "g8-p64", "--num-requests", "32",
                    "--own-len", "16", "--repeats", "1", "--out", str(out)],
                   check=True, capture_output=True)
    row = json.loads(out.with_suffix(".json").read_text())["results"][0]
    assert (row["num_requests"], row["degree"], row["prefix_len"], row["own_len"]) == (32, 8, 64, 16)
    assert row["token_ids"] == 32 * 80 and row["encode_prompt_s"] > 0 and row["group_prompts_s"] > 0
    assert "encode_prompt s" in out.with_suffix(".md").read_text()


def test_generate_intake_is_timed_up_to_the_first_step(tmp_path):
    out = tmp_path / "intake"
    subprocess.run([sys.executable, "scripts/bench_prompt_intake.py", "--workload", "g8-p64", "--num-requests", "32",
                    "--own-len", "16", "--repeats", "2", "--generate", "--out", str(out)],
                   check=True, capture_output=True)
    row = json.loads(out.with_suffix(".json").read_text())["results"][0]
    assert row["generate_intake_first_s"] > 0 and row["generate_intake_s"] > 0
    assert row["generate_intake_no_groups_first_s"] > 0 and row["generate_intake_no_groups_s"] > 0
    for key in ("generate_intake_phases_s", "generate_intake_no_groups_phases_first_s"):
        assert set(row[key]) == {"prompts", "grouping", "scheduling"}
    # The phases lie inside the whole; without groups nothing is grouped.
    assert sum(row["generate_intake_phases_first_s"].values()) <= row["generate_intake_first_s"]
    assert row["generate_intake_phases_first_s"]["grouping"] > 0
    assert row["generate_intake_no_groups_phases_first_s"]["grouping"] == 0
    md = out.with_suffix(".md").read_text()
    assert "generate intake s (first / median)" in md and "without groups" in md
