"""scripts/bench_prompt_intake.py: its RFC-shaped prompts group as the job's do, and a small
run writes its figures."""
import json
import subprocess
import sys

from engine.prefix_groups import group_prompts
from scripts.bench_prompt_intake import rfc_prompts


def test_rfc_prompts_form_one_group_per_shared_prefix():
    prompts = rfc_prompts(64, degree=16, prefix_len=32, own_len=8)
    assert len(prompts) == 64 and all(len(p) == 40 for p in prompts)
    groups = group_prompts(prompts, 16)
    assert sorted((len(g.members), g.prefix_len) for g in groups) == [(16, 32)] * 4


def test_a_small_run_writes_both_timings(tmp_path):
    out = tmp_path / "intake"
    subprocess.run([sys.executable, "scripts/bench_prompt_intake.py", "--num-requests", "32", "--degree", "8",
                    "--prefix-len", "64", "--own-len", "16", "--repeats", "1", "--out", str(out)],
                   check=True, capture_output=True)
    row = json.loads(out.with_suffix(".json").read_text())["results"][0]
    assert row["token_ids"] == 32 * 80 and row["encode_prompt_s"] > 0 and row["group_prompts_s"] > 0
    assert "encode_prompt s" in out.with_suffix(".md").read_text()
