"""The table of gc_pauses.md from the runs' results and step traces (run from the repository
root: python3 benchmarks/h200/gc_pauses_table.py). GPU busy: the steps' GPU time summed;
idle: elapsed minus that; pauses: steps whose host phases ran over the GPU's step by > 100 ms."""
import gzip
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = [("1", "rfc6400_gc_groups_256_87d9080"), ("1", "rfc6400_gc_groups_512_87d9080"),
        ("1", "rfc6400_gc_apc_512_87d9080"), ("2", "rfc6400_gc2_groups_512_base_87d9080"),
        ("2", "rfc6400_gc2_groups_512_e991690"), ("2", "rfc6400_gc2_apc_512_e991690"),
        ("2", "rfc6400_gc2_groups_256_e991690")]

print("| call | run | mode | max_num_seqs | req/s | elapsed s | GPU busy s | GPU idle s | intake s "
      "| pauses > 100 ms (count, s over the GPU) |")
print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
for call, name in RUNS:
    with open(os.path.join(HERE, name + ".json")) as f:
        data = json.load(f)
    r = data["results"][0]
    with gzip.open(os.path.join(HERE, name + "_trace.json.gz"), "rt") as f:
        rows = json.load(f)["rows"]
    busy = sum(row[7] for row in rows) / 1e3
    over = [sum(row[1:7]) - row[7] for row in rows]
    pauses = [o for o in over if o > 100]
    print(f"| {call} | {name} | {r['mode']} | {data['meta']['settings']['max_num_seqs']} | "
          f"{r['requests_per_s']:.2f} | {r['elapsed_s']:.2f} | {busy:.2f} | "
          f"{r['elapsed_s'] - busy:.2f} | {r['intake_s']:.2f} | {len(pauses)}, {sum(pauses) / 1e3:.2f} |")
