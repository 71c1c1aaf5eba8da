#!/bin/bash
# one-off GPU run (not committed): issue 11's acceptance command twice at e39ab9d (final-first outbox)
bash .gpu-kit/install.sh > /tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
export BENCH_COMMIT=e39ab9d
W=/tmp/w; mkdir -p $W
for run in 1 2; do
  timeout 285 python3 scripts/bench_serving.py --gpus 1 --concurrency 256 --clients 4 --out $W/serving_256_e39ab9d_run$run > $W/run$run.log 2>&1
  echo "run $run rc=$?"
  cat $W/serving_256_e39ab9d_run$run.md
done
cd /tmp && tar czf $OUT/repeat.tgz w
