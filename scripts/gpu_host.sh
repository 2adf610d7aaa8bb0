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
#   bash scripts/build_release_overlay.sh 0.5.14 .bundle   # HERE: .bundle/rel-0.5.14 (what 0.5.14 pins unlike 0.5.12)
#   bash scripts/gpu_host.sh install-rel 0.5.14     # after install-b: /tmp/site-0.5.14 (carry .bundle/rel-0.5.14, .bundle/kvc);
#                                                   # later steps with KVC_GPU_RELEASE=0.5.14 run that release
#   bash scripts/gpu_host.sh install-line-a         # in place of install-a (carry .bundle/line-a)
#   bash scripts/gpu_host.sh install-line-b         # in place of install-b (carry .bundle/line-b, .bundle/kvc)
#   KVC_GPU_LINE=0.5.23 bash scripts/gpu_host.sh bundle   # HERE: .bundle/l23-{1..N} (scripts/build_l23_bundle.sh:
#                                                   # sglang 0.5.23 + torch 2.14.1, numbered parts of <= 50 MiB)
#   bash scripts/gpu_host.sh stage-l23 N            # copy part N into /tmp/l23-parts (carry .bundle/l23-N)
#   bash scripts/gpu_host.sh install-l23            # join + sha256 + pip into /tmp/site23 (all parts staged)
#   bash scripts/gpu_host.sh check-l23 [--flashinfer]  # versions, a CUDA matmul, sgl_kernel's sm90 ops, sglang's
#                                                   # HTTP server module (with --flashinfer: a JIT-built rmsnorm)
#                                                   # (KVC_GPU_LINE=0.5.23 STEP: any later step on /tmp/site23)
#   bash scripts/gpu_host.sh bench-start [args]     # benchmarks/bench_overhead.py in the background (setsid)
#   bash scripts/gpu_host.sh bench-wait [seconds]   # wait for it (default 570 s; every *-wait stops 45 s before the
#                                                   # call's 600 s: KVC_CALL_LIMIT_S); results + logs into $OUT
#     e.g. `all` in steady state (issue 60; every KV slot written first): bench-start --cpu-set auto --fill-pool --rows
#     decode_bs1,decode_bs64,decode_bs1_all,decode_bs64_all --configs off,ours_idle,ours_all_rows,off
#     (KVC_BENCH_DIR=/tmp/kvc-bench-1 CUDA_VISIBLE_DEVICES=1 ...: a second bench on the second GPU, its own folder)
#   bash scripts/gpu_host.sh prof-start [args]      # benchmarks/profile_decode.py in the background (after install-b)
#   bash scripts/gpu_host.sh prof-wait [seconds]    # wait for it (default 570 s): profile.log, summary.json into $OUT
#     e.g. the decode bs1 bisect (docs/results/gpu-h200-2026-12-01d-bs1-bisect): install-a; then install-b && prof-start
#     --batches 1 --configs "off,ours_idle,load:ours_idle;KVC_DIAG_PRECOMPILE_LAUNCH=load" && prof-wait 480
#   bash scripts/gpu_host.sh unit [pytest args]     # kernel/runner unit tests on the GPU (CUDA graphs too)
#   bash scripts/gpu_host.sh decode-kernels [args]  # bench_decode_kernels.py: this tree (and .bench-base/python)
#   bash scripts/gpu_host.sh hash-term [args]       # bench_hash_term.py: read / mix32 / linear word terms, GB/s
#   bash scripts/gpu_host.sh fused-attention-hash [args]  # bench_fused_attention_hash.py: decode attention, one
#                                                   # layer, alone and with each term hashed where it loads K and V
#   bash scripts/gpu_host.sh e2e [pytest args]      # the registered CUDA suite (real sglang, CUDA graphs)
#   bash scripts/gpu_host.sh e2e-bg NAME FILES.. [-k ..]  # e2e files in the background (one per GPU with
#   bash scripts/gpu_host.sh e2e-collect NAME [s]   #   CUDA_VISIBLE_DEVICES); collect: wait up to s, logs into $OUT
#   bash scripts/gpu_host.sh bench [args]           # old foreground form: bench_kernels.py + bench_overhead.py
#   bash scripts/gpu_host.sh bundle-fa3             # HERE: .bundle/fa3-{1..N} (scripts/build_fa3_addon.sh: sgl_kernel's FA3
#                                                   # library, which the line bundles leave out; KVC_GPU_LINE=0.5.23 for 0.5.23's)
#   bash scripts/gpu_host.sh stage-fa3 N            # after the line's install: part N into /tmp/fa3-parts (carry .bundle/fa3-N)
#   bash scripts/gpu_host.sh install-fa3            # join + sha256 into the line's sgl_kernel (--attention-backend fa3 loads)
#   bash scripts/gpu_host.sh bundle-pd              # HERE: .bundle/pd-{1,2,3} (scripts/build_pd_bundle.sh: CUDA
#                                                   # mooncake split in 45 MiB pieces, sglang-router, Ubuntu debs)
#   bash scripts/gpu_host.sh install-pd-part N      # copy .bundle/pd-N into /tmp/pd-parts (carry .bundle/pd-N)
#   bash scripts/gpu_host.sh install-pd             # join + sha256 + pip into /tmp/site, debs into /tmp/pd-libs
#   bash scripts/gpu_host.sh pd-check               # mooncake TCP transfer GPU -> GPU in one process (no sglang)
#   bash scripts/gpu_host.sh pd-e2e [pytest args]   # test_e2e_pd.py on the GPU; server logs into $OUT
#   bash scripts/gpu_host.sh pd-bench-start [args]  # benchmarks/bench_pd_overhead.py in the background (after install-pd)
#   bash scripts/gpu_host.sh pd-bench-wait [seconds] # as bench-wait: bench_overhead.json (the PD report) + logs
#   bash scripts/gpu_host.sh hicache-e2e [pytest args]  # test_e2e_hicache.py on the GPU (sglang's own HiCache
#                                                   # transfers, CUDA graphs); server logs into $OUT
#   bash scripts/gpu_host.sh hicache-storage-e2e [pytest args]  # test_e2e_hicache_storage.py on the GPU (file
#                                                   # storage tier); server logs into $OUT
#   bash scripts/gpu_host.sh hc-bench-start [args]  # benchmarks/bench_hicache_overhead.py in the background
#   bash scripts/gpu_host.sh hc-bench-wait [seconds] # as bench-wait: bench_overhead.json (the HiCache report) + logs
#
# The PD e2e on the GPU (issue 25; both servers on one GPU, mooncake over TCP on 127.0.0.1), all calls back to back:
#   1. install-a                                      carry [.bundle/part-a]                      timeout 300
#   2. install-b                                      carry [.bundle/part-b, .bundle/kvc]         timeout 300
#   3. install-pd-part 1                              carry [.bundle/pd-1]                        timeout 120
#   4. install-pd-part 2                              carry [.bundle/pd-2]                        timeout 120
#   5. install-pd-part 3 && install-pd && { pd-check; pd-e2e -k TestPDClean; }   carry [.bundle/pd-3]
#                                                     (each step as `bash scripts/gpu_host.sh STEP`)  timeout 600
#   6. pd-e2e -k TestPDPerturbed                      (no carry)                                  timeout 600
#   The PD pair's overhead row (off / ours / off on both sides, ~10 min): after step 5's installs,
#      pd-bench-start && pd-bench-wait 540, then pd-bench-wait until BENCH_DONE        timeout 600 each
#   On sglang 0.5.23 (issue 52): the 0.5.23 bundle's calls first (stage-l23 1..N, install-l23), then steps 3-6 with
#   KVC_GPU_LINE=0.5.23 (install-pd then installs mooncake's CUDA build, 0.3.13.post1 as the CPU CI's 0.5.23 venv has, into
#   /tmp/site23; torch 2.14.1+cu130 brings the libcudart.so.13 it links)
# (one install-pd-part per part that bundle-pd printed; pd-e2e finds /tmp/pd-libs/lib by itself, skips with the
# reason when mooncake's CUDA build does not load, stops pytest with SIGINT after KVC_PD_E2E_TIMEOUT s (480) so
# that its logs come back, and leaves gpu-pd-e2e.log and pd-logs.tgz (server and router logs) in $OUT)
#
# HiCache on the GPU (issue 24), back to back:
#   1. install-a                                      carry [.bundle/part-a]                      timeout 300
#   2. install-b && hicache-e2e && hc-bench-start     carry [.bundle/part-b, .bundle/kvc]         timeout 600
#      (the e2e ~5 min; the bench runs in the background: off / ours / off, ~5 min)
#   3. hc-bench-wait 540   (repeat until it prints BENCH_DONE)                                      timeout 600
#   The paired row (all servers at once, ~8 min): hc-bench-start --interleave --configs hc_off,hc_ours,hc_off
#      --reps 18 --mem-fraction-static 0.88 (the pooled row, five servers: --configs hc_off,hc_ours,hc_off,hc_ours,hc_ours_d2h4
#      --reps 10 on an H200: they do not fit an H100's memory; keep 0.88, sglang refuses a small fraction once
#      other servers hold memory) (add --sample-stacks for where the scheduler thread's time goes, or
#      --profile-batches 3 for the GPU's busy / idle split), then hc-bench-wait
#      (--server-arg '--decode-log-interval 8': sglang's decode lines inside a batch; --server-arg --sleep-on-idle:
#      idle servers sleep instead of spinning a core each) (--cpu-sets A:B:.. --rotate-cpu-sets: each server's process
#      tree on set (i + round) mod n; config hc_ours_idle: the canary installed, its per-forward work skipped)
#   The ablation row (H200, needs_h200; six servers up at once in ~190 s with --parallel-start, 16 rounds ~8.5 min):
#      hc-bench-start --interleave --parallel-start --configs hc_off,hc_ours_idle,hc_ours,hc_off,hc_ours_idle,hc_ours
#      --reps 16 --mem-fraction-static 0.88, then hc-bench-wait 560 at once (the host goes back 30 s after a call)
#      A later call can land on a fresh host (hc-bench-wait then says NO_BENCH at once): prefer one call with
#      --time-budget-s (the rounds that fit: ~190 s up, ~5 s a repetition, six servers ~10 rounds, four ~16), as
#      below. A cut-off run's bench.log still pairs: python3 benchmarks/paired_rounds.py bench.log
#   The pair row in one call (H200), with each turn's profile after it: install-b >/dev/null 2>&1; hc-bench-start
#      --interleave --parallel-start --configs hc_off,hc_ours,hc_off,hc_ours --reps 16 --time-budget-s 400
#      --mem-fraction-static 0.88 --profile-batches 2 --profile-turn 0,1 >/dev/null; sleep 5; hc-bench-wait 560
#      (the first server of each config profiles 2 batches of turn 0, fresh, and of turn 1, load-backs, after the
#      rounds: trace_summary in bench_overhead.json, the traces as trace-<server>-turn<N>.json.gz)
#   The boundary's host time over every timed batch: the same pair row with --host-timers in place of the profile
#      flags (each scheduler's boundary segments and the canary's and sglang's methods, in bench.log)
#
# sglang 0.5.23 on the GPU (issue 57), all calls back to back (the host keeps /tmp only while warm; a part's call
# takes ~5 s; N: the number of parts that `KVC_GPU_LINE=0.5.23 bash scripts/gpu_host.sh bundle` printed, 21 since 2026-12-01):
#   1..N-1. stage-l23 I                               carry [.bundle/l23-I]                       timeout 120
#   N. stage-l23 N && install-l23 && check-l23         carry [.bundle/l23-N, .bundle/kvc]          timeout 600
#      (each step as `bash scripts/gpu_host.sh STEP`; install-l23 says which parts are missing when the host went
#      cold in between: then stage them all again; check-l23 leaves check-l23.log in $OUT; with .bundle/kvc carried,
#      install-l23 installs the plugin into /tmp/site23 too, --no-deps: its wheel pins 0.5.12's sglang)
#   N+1. check-l23 --flashinfer                       (no carry)                                  timeout 600
#   Later steps on sglang 0.5.23: KVC_GPU_LINE=0.5.23 bash scripts/gpu_host.sh STEP (PYTHONPATH /tmp/site23)
#   e.g. every `all` row side by side (docs/results/gpu-h200-2026-12-02-every-row-all-0.5.23, ~17 min of servers):
#   N. ... && check-l23 && KVC_GPU_LINE=0.5.23 bash scripts/gpu_host.sh bench-start --fill-pool --rows decode_bs1,
#      decode_bs32,decode_bs64,prefill_bs8,shared_prefix,decode_bs1_all,decode_bs32_all,decode_bs64_all,
#      prefill_bs8_all,shared_prefix_all --configs off,ours_idle,ours_all_rows,intree_all_rows,off >/dev/null;
#      sleep 3; KVC_GPU_LINE=0.5.23 bash scripts/gpu_host.sh bench-wait 440; then bench-wait 575 until BENCH_DONE
#   The shared-prefix row's HEAD in the kernel rig (no sglang): decode-kernels --no-hicache --real-data all
#      --cases 64x4160 --shared-prefix 4096 --pool-slots 280000 --lm-head 128256 (without --shared-prefix: every
#      request reads slots of its own, the rig of 2026-12-01b)
#
# The side-by-side benchmark (off / ours / upstream 0.5.14, ~18 min of servers) as device `run` calls:
#   1. install-a                                      carry [.bundle/part-a]            timeout 300
#   2. install-b && unit -k "index_sweep or ring_reader or kernels"   carry [.bundle/part-b, .bundle/kvc]
#                                                     (the new CUDA paths, compiled; ~2 min)  timeout 420
#   3. install-upstream && bench-start && bench-wait 480   carry [.bundle/upstream]     timeout 600
#      (never pipe bench-start into another command: the background run holds the pipe open)
#   4. bench-wait 570   (repeat until it prints BENCH_DONE)                                timeout 600
# Each bench-wait leaves overhead.json, overhead_extra.json, bench_overhead.json, bench.log and
# server-logs.tgz in $OUT (partial until BENCH_DONE). Then, here: keep them in a docs/results/ folder of the run,
# update the rows it measured in docs/results/overhead.json (the current table) and run
# python benchmarks/overhead_report.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-gpu-out}"; mkdir -p "$out"
step="${1:?step}"; shift || true
site=/tmp/site  # sglang 0.5.23's bundle installs into its own folder (torch 2.14.1 there)
case "$step" in *-l23) site=/tmp/site23 ;; esac; [ "${KVC_GPU_LINE:-}" != 0.5.23 ] || site=/tmp/site23
# a release overlay (build_release_overlay.sh) in front of the 0.5.12 bundle: KVC_GPU_RELEASE=0.5.14 STEP
[ -z "${KVC_GPU_RELEASE:-}" ] || site="/tmp/site-$KVC_GPU_RELEASE:$site"
export PYTHONPATH="$site:$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# nvidia-cutlass-dsl's .pth puts dsl_packages (cutlass) on sys.path only from a site folder, not from PYTHONPATH
[ ! -d "$site/nvidia_cutlass_dsl/dsl_packages" ] || export PYTHONPATH="$PYTHONPATH:$site/nvidia_cutlass_dsl/dsl_packages"
bench_dir="${KVC_BENCH_DIR:-/tmp/kvc-bench}"  # another folder: a second bench at once (e.g. one per GPU)

wait_limit() {  # SECONDS asked -> what a *-wait step may wait: never past the device call's own limit
  # (KVC_CALL_LIMIT_S, default 600) less 45 s to copy the results, counted from when the call's shell (this
  # script's parent) started: a wait after an install in the same call would otherwise run the call past its
  # limit, and the results would be lost with the host (2026-12-02e)
  local asked="$1" call_limit="${KVC_CALL_LIMIT_S:-600}" tick start up elapsed left
  tick=$(getconf CLK_TCK); start=$(awk '{print $22}' "/proc/$PPID/stat" 2>/dev/null || echo "")
  up=$(cut -d' ' -f1 /proc/uptime)
  [ -n "$start" ] || { echo "$asked"; return; }
  elapsed=$(awk -v u="$up" -v s="$start" -v t="$tick" 'BEGIN {printf "%d", u - s / t}')
  [ "$elapsed" -lt "$call_limit" ] || { echo "$asked"; return; }  # the parent outlived any call: not the call's shell
  left=$((call_limit - 45 - elapsed)); [ "$left" -gt 0 ] || left=0
  if [ "$left" -lt "$asked" ]; then
    echo "wait capped at ${left} s (asked ${asked} s): this call has run ${elapsed} s of ${call_limit} s" >&2
    echo "$left"
  else echo "$asked"; fi
}
gpu_e2e() {  # FILE SECONDS DIR LOG TGZ [pytest args]: one registered e2e file on the GPU, stopped with SIGINT after
  # SECONDS so that its logs come back; its output in $out/LOG, its servers' logs (under /tmp/DIR) in $out/TGZ
  local file="$1" limit="$2" dir="$3" log="$4" tgz="$5" rc=0; shift 5
  rm -rf "/tmp/$dir"
  KVC_TEST_DEVICE=cuda timeout -s INT -k 60 "$limit" python3 -m pytest -q -rs -s -p no:cacheprovider \
    --basetemp="/tmp/$dir" "test/registered/kv_canary/$file" "$@" 2>&1 | tee "$out/$log" || rc=$?
  [ ! -d "/tmp/$dir" ] || tar czf "$out/$tgz" -C /tmp "$dir"
  return "$rc"
}
case "$step" in
  bundle)  # runs on the development machine: build every upload and check it fits one call
    rm -rf .bundle/kvc; mkdir -p .bundle
    if [ -z "${KVC_GPU_LINE:-}" ]; then
      [ -f .bundle/part-a/install.sh ] || bash scripts/build_bundle.sh .bundle
      [ -f .bundle/upstream/install.sh ] || bash scripts/build_bundle.sh --upstream .bundle
    fi
    python3 -m pip wheel -q --no-deps -w .bundle/kvc .
    calls=("part-a" "part-b kvc" "upstream")
    if [ "${KVC_GPU_LINE:-}" = 0.5.23 ]; then  # numbered parts, one call each (scripts/build_l23_bundle.sh)
      grep -qF "$(bash scripts/build_l23_bundle.sh --stamp)" .bundle/l23-1/MARK 2>/dev/null \
        || bash scripts/build_l23_bundle.sh .bundle
      calls=(); for d in .bundle/l23-[0-9]*; do calls+=("${d#.bundle/}"); done
      mapfile -t calls < <(printf '%s\n' "${calls[@]}" | sort -t- -k2 -n)
    elif [ -n "${KVC_GPU_LINE:-}" ]; then  # a newer sglang line's bundle, in place of part-a/-b (build_line_bundle.sh)
      [ -f .bundle/line-a/install.sh ] && grep -q "sglang $KVC_GPU_LINE bundle" .bundle/line-a/install.sh \
        || bash scripts/build_line_bundle.sh "$KVC_GPU_LINE" .bundle
      calls=("line-a" "line-b kvc")
    fi
    tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    for call in "${calls[@]}"; do
      b=0; for d in $call; do b=$((b + $(du -sb ".bundle/$d" | cut -f1))); done
      t=$((b + tree)); echo "upload [$call] + tree: $((t / 1048576)) MiB of 64"
      [ "$t" -lt $((64 * 1048576)) ] || { echo "too large for one call: [$call]" >&2; exit 1; }
    done
    if [ "${KVC_GPU_LINE:-}" = 0.5.23 ]; then
      echo "sglang 0.5.23 bundle: ${#calls[@]} parts (MiB):"
      for c in "${calls[@]}"; do printf '  %s %.1f\n' "$c" "$(du -sb ".bundle/$c" | awk '{print $1 / 1048576}')"; done
    fi ;;
  bundle-pd)  # runs on the development machine: the PD extras in parts, each checked to fit one call
    bash scripts/build_pd_bundle.sh .bundle
    tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    for d in .bundle/pd-[0-9]*; do
      t=$(($(du -sb "$d" | cut -f1) + tree)); echo "upload [${d#.bundle/}] + tree: $((t / 1048576)) MiB of 64"
      [ "$t" -lt $((64 * 1048576)) ] || { echo "too large for one call: [$d]" >&2; exit 1; }
    done ;;
  bundle-fa3)  # runs on the development machine: sgl_kernel's FA3 library (fa3 backend) in parts (KVC_GPU_LINE picks)
    bash scripts/build_fa3_addon.sh .bundle ;;
  stage-fa3)  # one part of the FA3 add-on into /tmp/fa3-parts (carry .bundle/fa3-N)
    n="${1:?stage-fa3 N}"; [ -d ".bundle/fa3-$n" ] || { echo "no .bundle/fa3-$n (carry it)" >&2; exit 1; }
    mkdir -p /tmp/fa3-parts; cp -r ".bundle/fa3-$n/." /tmp/fa3-parts/
    echo "fa3 part $n of $(cat /tmp/fa3-parts/N_PARTS) staged ($(ls /tmp/fa3-parts/piece.* | wc -l) pieces)" ;;
  install-fa3)  # after every stage-fa3 and the line's install (same warm host): flash_ops beside the trimmed sgl_kernel
    k="${site##*:}/sgl_kernel"; [ -d "$k" ] || { echo "NO_INSTALL: no $k (install the line first)" >&2; exit 3; }
    [ "$(ls /tmp/fa3-parts/piece.* 2>/dev/null | wc -l)" = "$(cat /tmp/fa3-parts/N_PARTS 2>/dev/null)" ] \
      || { echo "NO_PARTS: $(ls /tmp/fa3-parts/piece.* 2>/dev/null | wc -l) of $(cat /tmp/fa3-parts/N_PARTS 2>/dev/null) staged" >&2; exit 3; }
    cat /tmp/fa3-parts/piece.* | gunzip > "$k/flash_ops.abi3.so"
    echo "$(cat /tmp/fa3-parts/SO_SHA256)  $k/flash_ops.abi3.so" | sha256sum -c -
    python3 -c 'import torch; from sgl_kernel import flash_ops; print("sgl_kernel.flash_ops loads:", flash_ops.__file__)' ;;
  install-pd-part)
    n="${1:?install-pd-part N}"; [ -d ".bundle/pd-$n" ] || { echo "no .bundle/pd-$n (carry it)" >&2; exit 1; }
    mkdir -p /tmp/pd-parts; cp -r ".bundle/pd-$n/." /tmp/pd-parts/
    echo "pd part $n of $(cat /tmp/pd-parts/N_PARTS) in /tmp/pd-parts"; du -sh /tmp/pd-parts ;;
  install-pd)  # after install-a/-b (or install-l23 with KVC_GPU_LINE=0.5.23) and every install-pd-part (same warm host)
    PD_SITE="${site%%:*}" bash /tmp/pd-parts/install.sh  # the line's site: /tmp/site, or /tmp/site23 for 0.5.23
    export LD_LIBRARY_PATH="/tmp/pd-libs/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    python3 - <<'PY'
import torch, mooncake.engine, sglang_router.launch_router  # noqa: F401  (torch first: it loads libcudart)
from importlib.metadata import distributions
names = sorted({f"{d.metadata['Name']} {d.version}" for d in distributions()
                if d.metadata["Name"].lower().replace("_", "-").startswith(("mooncake", "sglang-router"))})
print("install-pd: mooncake.engine and sglang_router.launch_router import:", ", ".join(names))
PY
    ;;
  pd-check)
    export LD_LIBRARY_PATH="/tmp/pd-libs/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    python3 scripts/pd_transfer_check.py --device cuda 2>&1 | grep -v "^I[0-9]" ;;
  pd-e2e) gpu_e2e test_e2e_pd.py "${KVC_PD_E2E_TIMEOUT:-480}" kvc-pd gpu-pd-e2e.log pd-logs.tgz "$@" ;;
  hicache-e2e)
    gpu_e2e test_e2e_hicache.py "${KVC_HC_E2E_TIMEOUT:-480}" kvc-hc gpu-hicache-e2e.log hicache-logs.tgz "$@" ;;
  hicache-storage-e2e)
    gpu_e2e test_e2e_hicache_storage.py "${KVC_HC_E2E_TIMEOUT:-480}" kvc-hcs gpu-hicache-storage-e2e.log \
      hicache-storage-logs.tgz "$@" ;;
  install-upstream)
    bash .bundle/upstream/install.sh
    PYTHONPATH="/tmp/site-upstream:$PYTHONPATH" python3 -c 'import sglang; print("upstream sglang", sglang.__version__)' ;;
  bench-start|pd-bench-start|hc-bench-start)  # pd-: bench_pd_overhead.py (after install-pd); hc-: HiCache
    script=benchmarks/bench_overhead.py
    if [ "$step" = pd-bench-start ]; then
      script=benchmarks/bench_pd_overhead.py; bench_dir=/tmp/kvc-pd-bench
      export LD_LIBRARY_PATH="/tmp/pd-libs/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    elif [ "$step" = hc-bench-start ]; then
      script=benchmarks/bench_hicache_overhead.py; bench_dir=/tmp/kvc-hc-bench
    fi
    [ ! -f "$bench_dir/pid" ] || ! kill -0 "$(cat "$bench_dir/pid")" 2>/dev/null || { echo "a bench is running" >&2; exit 1; }
    python3 -c 'import sglang' 2>/dev/null || {  # a fresh host (the installed one went back): say so, at once
      echo "NO_INSTALL: sglang is not importable from /tmp/site: run install-a and install-b on this host first" >&2
      exit 3; }
    mkdir -p "$bench_dir"; rm -f "$bench_dir/rc"
    (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true) | tee "$bench_dir/gpu-info.txt"
    extra=(--results-dir "$bench_dir"); [ "$step" = bench-start ] || extra=()
    setsid bash -c 'script="$1"; shift; python3 "$script" --out "$0/bench_overhead.json" --log-dir "$0/logs" "$@" \
      > "$0/bench.log" 2>&1; echo $? > "$0/rc"' "$bench_dir" "$script" "${extra[@]}" "$@" < /dev/null > /dev/null 2>&1 &
    echo $! > "$bench_dir/pid"
    sleep 5; echo "bench started in the background: $bench_dir/bench.log"; tail -5 "$bench_dir/bench.log" ;;
  bench-wait|pd-bench-wait|hc-bench-wait)
    [ "$step" != pd-bench-wait ] || bench_dir=/tmp/kvc-pd-bench
    [ "$step" != hc-bench-wait ] || bench_dir=/tmp/kvc-hc-bench
    limit=$(wait_limit "${1:-570}"); t0=$SECONDS
    if [ ! -f "$bench_dir/pid" ]; then  # a fresh host: the one that ran the bench went back (30 s idle); say so now
      echo "NO_BENCH: no bench was started on this host ($bench_dir/pid missing): the host that ran it went back" >&2
      exit 3
    fi
    while [ ! -f "$bench_dir/rc" ] && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 10; done
    for f in overhead.json overhead_extra.json bench_overhead.json bench.log gpu-info.txt; do
      [ -f "$bench_dir/$f" ] && cp "$bench_dir/$f" "$out/"
    done
    [ -d "$bench_dir/logs" ] && tar czf "$out/server-logs.tgz" --exclude="*.trace.json*" -C "$bench_dir" logs
    for d in "$bench_dir"/logs/profile-*; do  # --profile-batches: each server's trace, where it is small enough
      t=$(ls -t "$d"/*.trace.json* 2>/dev/null | head -1 || true)
      if [ -n "$t" ] && [ "$(stat -c %s "$t")" -lt 15000000 ]; then cp "$t" "$out/trace-${d##*/profile-}.json.gz"; fi
    done
    tail -40 "$bench_dir/bench.log"
    if [ -f "$bench_dir/rc" ]; then echo "BENCH_DONE rc=$(cat "$bench_dir/rc")"; else echo "BENCH_RUNNING"; fi ;;
  prof-start)  # benchmarks/profile_decode.py in the background (setsid), after install-b; args: profile_decode's
    mkdir -p /tmp/kvc-prof; rm -f /tmp/kvc-prof/rc
    setsid bash -c 'python3 benchmarks/profile_decode.py --out /tmp/kvc-prof/summary.json "$@" > /tmp/kvc-prof/log 2>&1
      echo $? > /tmp/kvc-prof/rc' prof "$@" < /dev/null > /dev/null 2>&1 &
    sleep 3; echo "profile started in the background: /tmp/kvc-prof/log"; tail -3 /tmp/kvc-prof/log ;;
  prof-wait)  # [seconds]: wait for it (default 570 s); its log and summary (partial until PROF_DONE) into $OUT
    [ -d /tmp/kvc-prof ] || { echo "NO_PROFILE: none was started on this host (it went back?)" >&2; exit 3; }
    limit=$(wait_limit "${1:-570}"); t0=$SECONDS
    while [ ! -f /tmp/kvc-prof/rc ] && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 10; done
    cp /tmp/kvc-prof/log "$out/profile.log"; [ ! -f /tmp/kvc-prof/summary.json ] || cp /tmp/kvc-prof/summary.json "$out/"
    grep -E "starting server|FAILED" /tmp/kvc-prof/log || true
    if [ -f /tmp/kvc-prof/rc ]; then echo "PROF_DONE rc=$(cat /tmp/kvc-prof/rc)"; else echo "PROF_RUNNING"; fi ;;
  install-a) bash .bundle/part-a/install.sh; nvidia-smi -L; python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' ;;
  install-b)
    bash .bundle/part-b/install.sh
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .bundle/kvc/*.whl
    python3 -c 'import sglang; from kv_canary.adapter.lines import current_choice as c; print("sglang", sglang.__version__, "line:", c().line.name if c().line else c().reason)' ;;
  stage-l23)  # one part of the sglang 0.5.23 bundle into /tmp/l23-parts (carry .bundle/l23-N)
    n="${1:?stage-l23 N}"; [ -d ".bundle/l23-$n" ] || { echo "no .bundle/l23-$n (carry it)" >&2; exit 1; }
    mkdir -p /tmp/l23-parts; cp -r ".bundle/l23-$n/." /tmp/l23-parts/
    echo "l23 part $n of $(cat /tmp/l23-parts/N_PARTS) in /tmp/l23-parts; staged so far:" \
      "$(cd /tmp/l23-parts && while read -r i f; do [ ! -e "$f" ] || echo "$i"; done < PART_OF | sort -un | tr '\n' ' ')" ;;
  install-l23)  # after stage-l23 1..N (same warm host): /tmp/site23, then the import the lead needs
    [ -f /tmp/l23-parts/install.sh ] || { echo "NO_PARTS: nothing staged in /tmp/l23-parts (a fresh host?)" >&2; exit 3; }
    t0=$SECONDS; bash /tmp/l23-parts/install.sh; echo "install-l23: $((SECONDS - t0)) s"
    if compgen -G ".bundle/kvc/*.whl" >/dev/null; then  # the plugin (entry point) beside 0.5.23
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site23 --upgrade .bundle/kvc/*.whl
    fi
    python3 -c "import torch, sglang; print(sglang.__version__, torch.__version__, torch.cuda.is_available())" ;;
  check-l23) python3 scripts/check_l23.py "$@" 2>&1 | tee "$out/check-l23.log" ;;
  install-rel)  # RELEASE: its overlay into /tmp/site-RELEASE, after install-a/-b (carry .bundle/rel-RELEASE)
    r="${1:?install-rel RELEASE}"; bash ".bundle/rel-$r/install.sh"
    # the plugin beside it: test servers put the plugin's own folder first on PYTHONPATH, so it must be the overlay
    python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-$r" --upgrade .bundle/kvc/*.whl
    PYTHONPATH="/tmp/site-$r:$PYTHONPATH" python3 -c 'import sglang, torch; from kv_canary.adapter.lines import current_choice as c; print("sglang", sglang.__version__, torch.__version__, torch.cuda.is_available(), "line:", c().line.name if c().line else c().reason)' ;;
  install-line-a) bash .bundle/line-a/install.sh; nvidia-smi -L ;;
  install-line-b)  # after install-line-a (same warm host), with the plugin's wheel: the plugin picks its line
    bash .bundle/line-b/install.sh
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .bundle/kvc/*.whl
    python3 -c 'import sglang; from kv_canary.adapter.lines import current_choice as c; print("sglang", sglang.__version__, "line:", c().line.name if c().line else c().reason)' ;;
  unit) python3 -m pytest -q -rs test/unit -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu-unit.log" ;;
  decode-kernels)  # one decode forward's canary kernels with HiCache's settings (no sglang needed): this tree, and
    # the tree under .bench-base/python if carried (e.g. `git archive REV python | tar -x -C .bench-base`)
    PYTHONPATH="$PWD/python" python3 benchmarks/bench_decode_kernels.py --label new --out "$out/decode-new.json" "$@" \
      2>&1 | grep -v -i "warn" | tee "$out/decode-new.log"
    if [ -d .bench-base/python ]; then
      PYTHONPATH="$PWD/.bench-base/python" python3 benchmarks/bench_decode_kernels.py --label base \
        --out "$out/decode-base.json" "$@" 2>&1 | grep -v -i "warn" | tee "$out/decode-base.log"
    fi ;;
  hash-term)  # bench_hash_term.py: a FULL_HASH word term's cost at memory speed (no sglang needed)
    PYTHONPATH="$PWD/python" python3 benchmarks/bench_hash_term.py --out "$out/hash_term.json" "$@" 2>&1 \
      | grep -v -i "warn" | tee "$out/hash_term.log" ;;
  fused-attention-hash)  # bench_fused_attention_hash.py: one layer's decode attention with and without a hash term
    PYTHONPATH="$PWD/python" python3 benchmarks/bench_fused_attention_hash.py --out "$out/fused_attention_hash.json" \
      "$@" 2>&1 | grep -v -i "warn" | tee "$out/fused_attention_hash.log" ;;
  e2e) python3 scripts/run_suite.py --hw cuda -- -p no:cacheprovider -s "$@" 2>&1 | tee "$out/gpu-e2e.log" ;;
  e2e-bg)  # NAME [pytest args]: registered e2e files on the GPU in the background (setsid), in /tmp/kvc-e2e-NAME
    # (one per GPU with CUDA_VISIBLE_DEVICES); e2e-collect NAME [seconds] waits for it and copies its logs into $OUT
    name="${1:?e2e-bg NAME [pytest args]}"; shift; dir="/tmp/kvc-e2e-$name"; rm -rf "$dir"; mkdir -p "$dir"
    KVC_TEST_DEVICE=cuda setsid bash -c 'd="$0"; python3 -m pytest -q -rs -s -p no:cacheprovider \
      --basetemp="$d/pt" "$@" > "$d/e2e.log" 2>&1; echo $? > "$d/rc"' "$dir" "$@" < /dev/null > /dev/null 2>&1 &
    echo "e2e $name started: $dir/e2e.log" ;;
  e2e-collect)
    name="${1:?e2e-collect NAME [seconds]}"; dir="/tmp/kvc-e2e-$name"; wait_s=$(wait_limit "${2:-0}")
    [ -d "$dir" ] || { echo "NO_E2E: $dir missing (a fresh host?)"; exit 3; }
    for _ in $(seq "$wait_s"); do [ ! -f "$dir/rc" ] || break; sleep 1; done
    cp "$dir/e2e.log" "$out/e2e-$name.log"; [ ! -d "$dir/pt" ] || tar czf "$out/e2e-$name-logs.tgz" -C "$dir" pt
    if [ -f "$dir/rc" ]; then echo "E2E_DONE $name rc=$(cat "$dir/rc")"; else echo "E2E_RUNNING $name"; fi
    tail -5 "$dir/e2e.log" ;;
  bench)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu-info.txt"
    python3 benchmarks/bench_kernels.py --out "$out/bench_kernels.json" 2>&1 | tee "$out/bench-kernels.log"
    python3 benchmarks/bench_overhead.py --out "$out/bench_overhead.json" "$@" 2>&1 | tee "$out/bench-overhead.log" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
