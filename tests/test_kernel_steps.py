"""scripts/kernel_steps.py on a made-up kernel list: steps cut at the argmax, groups summed, the
own / prefix passes' overlap measured."""
import gzip
import json

from scripts import kernel_steps

# (name, start us, us): step 0 has the prefix pass start 90 us into a 100 us own pass (10 us
# together); step 1 runs them apart; a tail without an argmax is dropped.
KERNELS = [
    ("nvjet_sm90_tst_128x128", 0.0, 50.0), ("_own_kernel", 60.0, 100.0), ("_prefix_kernel", 150.0, 40.0),
    ("_merge_kernel", 191.0, 5.0), ("_chunk_max_kernel", 200.0, 2.0),
    ("_own_kernel", 300.0, 100.0), ("_prefix_kernel", 410.0, 40.0), ("_chunk_max_kernel", 460.0, 2.0),
    ("nvjet_sm90_tst_128x128", 500.0, 50.0),
]


def test_steps_groups_and_overlap(tmp_path, capsys):
    steps = kernel_steps.split_steps(KERNELS)
    assert [len(s) for s in steps] == [5, 3]
    first, second = (kernel_steps.summarize(s) for s in steps)
    assert first["gemm"] == 0.05 and first["own"] == 0.1 and first["prefix"] == 0.04
    assert abs(first["other"] - 0.007) < 1e-12 and first["span"] == 0.202
    assert abs(first["overlap"] - 0.01) < 1e-12 and second["overlap"] == 0.0
    path = tmp_path / "k.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(KERNELS, f)
    kernel_steps.main([str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| 0 | 5 | 0.05 | 0.10 | 0.04 |")
