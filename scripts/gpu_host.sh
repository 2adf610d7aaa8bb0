#!/usr/bin/env bash
# Steps on the offline GPU host (torch 2.11 + triton 3.6, Python 3.12, no package index), and the local
# step that builds what they install. The device tool uploads at most 64 MiB per call (working tree
# included), so each bundle part travels in its own call; /tmp/site and /tmp/site-upstream survive only
# while the host stays warm (30 s after a call), so issue the calls back to back.
#
#   bash scripts/gpu_host.sh bundle                 # HERE (not on the host): .bundle/{part-a,part-b,kvc,upstream}
#   bash scripts/gpu_host.sh install-a              # call 1 (carry .bundle/part-a)
#   bash scripts/gpu_host.sh install-b              # call 2 (carry .bundle/part-b and .bundle/kvc)
#   bash scripts/gpu_host.sh install-upstream       # sglang 0.5.14 into /tmp/site-upstream (carry .bundle/upstream)
#   KVC_GPU_LINE=0.5.17 bash scripts/gpu_host.sh bundle   # HERE: .bundle/line-{a,b} (sglang 0.5.17 in place of 0.5.12)
#   bash scripts/gpu_host.sh install-line-a         # in place of install-a (carry .bundle/line-a)
#   bash scripts/gpu_host.sh install-line-b         # in place of install-b (carry .bundle/line-b, .bundle/kvc)
#   bash scripts/gpu_host.sh bench-start [args]     # scripts/bench_overhead.py in the background (setsid)
#   bash scripts/gpu_host.sh bench-wait [seconds]   # wait for it (default 570 s); results + logs into $OUT
#   bash scripts/gpu_host.sh unit [pytest args]     # kernel/runner unit tests on the GPU (CUDA graphs too)
#   bash scripts/gpu_host.sh e2e [pytest args]      # the registered CUDA suite (real sglang, CUDA graphs)
#   bash scripts/gpu_host.sh bench [args]           # old foreground form: bench_kernels.py + bench_overhead.py
#
# The side-by-side benchmark (off / ours / upstream 0.5.14, ~18 min of servers) as device `run` calls:
#   1. install-a                                      carry [.bundle/part-a]            timeout 300
#   2. install-b && unit -k "index_sweep or ring_reader or kernels"   carry [.bundle/part-b, .bundle/kvc]
#                                                     (the new CUDA paths, compiled; ~2 min)  timeout 420
#   3. install-upstream && bench-start && bench-wait 480   carry [.bundle/upstream]     timeout 600
#      (never pipe bench-start into another command: the background run holds the pipe open)
#   4. bench-wait 570   (repeat until it prints BENCH_DONE)                                timeout 600
# Each bench-wait leaves overhead.json, overhead_extra.json, bench_overhead.json, bench.log and
# server-logs.tgz in $OUT (partial until BENCH_DONE). Then, here: copy overhead*.json into docs/results/
# and run python scripts/overhead_report.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-gpu-out}"; mkdir -p "$out"
export PYTHONPATH="/tmp/site:$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step="${1:?step}"; shift || true
bench_dir=/tmp/kvc-bench
case "$step" in
  bundle)  # runs on the development machine: build every upload and check it fits one call
    rm -rf .bundle/kvc; mkdir -p .bundle
    if [ -z "${KVC_GPU_LINE:-}" ]; then
      [ -f .bundle/part-a/install.sh ] || bash ../shared/gpu-host/build_bundle.sh .bundle
      [ -f .bundle/upstream/install.sh ] || bash ../shared/gpu-host/build_upstream_bundle.sh .bundle
    fi
    python3 -m pip wheel -q --no-deps -w .bundle/kvc .
    calls=("part-a" "part-b kvc" "upstream")
    if [ -n "${KVC_GPU_LINE:-}" ]; then  # a newer sglang line's bundle, in place of part-a/-b (build_line_bundle.sh)
      [ -f .bundle/line-a/install.sh ] && grep -q "sglang $KVC_GPU_LINE bundle" .bundle/line-a/install.sh \
        || bash scripts/build_line_bundle.sh "$KVC_GPU_LINE" .bundle
      calls=("line-a" "line-b kvc")
    fi
    tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    for call in "${calls[@]}"; do
      b=0; for d in $call; do b=$((b + $(du -sb ".bundle/$d" | cut -f1))); done
      t=$((b + tree)); echo "upload [$call] + tree: $((t / 1048576)) MiB of 64"
      [ "$t" -lt $((64 * 1048576)) ] || { echo "too large for one call: [$call]" >&2; exit 1; }
    done ;;
  install-upstream)
    bash .bundle/upstream/install.sh
    PYTHONPATH="/tmp/site-upstream:$PYTHONPATH" python3 -c 'import sglang; print("upstream sglang", sglang.__version__)' ;;
  bench-start)
    [ ! -f "$bench_dir/pid" ] || ! kill -0 "$(cat "$bench_dir/pid")" 2>/dev/null || { echo "a bench is running" >&2; exit 1; }
    mkdir -p "$bench_dir"; rm -f "$bench_dir/rc"
    (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true) | tee "$bench_dir/gpu-info.txt"
    setsid bash -c 'python3 scripts/bench_overhead.py --out "$0/bench_overhead.json" --results-dir "$0" \
      --log-dir "$0/logs" "$@" > "$0/bench.log" 2>&1; echo $? > "$0/rc"' "$bench_dir" "$@" < /dev/null > /dev/null 2>&1 &
    echo $! > "$bench_dir/pid"
    sleep 5; echo "bench started in the background: $bench_dir/bench.log"; tail -5 "$bench_dir/bench.log" ;;
  bench-wait)
    limit="${1:-570}"; t0=$SECONDS
    while [ ! -f "$bench_dir/rc" ] && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 10; done
    for f in overhead.json overhead_extra.json bench_overhead.json bench.log gpu-info.txt; do
      [ -f "$bench_dir/$f" ] && cp "$bench_dir/$f" "$out/"
    done
    [ -d "$bench_dir/logs" ] && tar czf "$out/server-logs.tgz" -C "$bench_dir" logs
    tail -40 "$bench_dir/bench.log"
    if [ -f "$bench_dir/rc" ]; then echo "BENCH_DONE rc=$(cat "$bench_dir/rc")"; else echo "BENCH_RUNNING"; fi ;;
  install-a) bash .bundle/part-a/install.sh; nvidia-smi -L; python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' ;;
  install-b)
    bash .bundle/part-b/install.sh
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .bundle/kvc/*.whl
    python3 -c 'import sglang; from kv_canary.adapter.lines import current_choice as c; print("sglang", sglang.__version__, "line:", c().line.name if c().line else c().reason)' ;;
  install-line-a) bash .bundle/line-a/install.sh; nvidia-smi -L ;;
  install-line-b)  # after install-line-a (same warm host), with the plugin's wheel: the plugin picks its line
    bash .bundle/line-b/install.sh
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .bundle/kvc/*.whl
    python3 -c 'import sglang; from kv_canary.adapter.lines import current_choice as c; print("sglang", sglang.__version__, "line:", c().line.name if c().line else c().reason)' ;;
  unit) python3 -m pytest -q -rs test/unit -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu-unit.log" ;;
  e2e) python3 scripts/run_suite.py --hw cuda -- -p no:cacheprovider -s "$@" 2>&1 | tee "$out/gpu-e2e.log" ;;
  bench)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu-info.txt"
    python3 scripts/bench_kernels.py --out "$out/bench_kernels.json" 2>&1 | tee "$out/bench-kernels.log"
    python3 scripts/bench_overhead.py --out "$out/bench_overhead.json" "$@" 2>&1 | tee "$out/bench-overhead.log" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
