#!/usr/bin/env bash
# Steps on the offline GPU host (torch 2.11 + triton 3.6, Python 3.12, no package index).
# Needs the bundle from shared/gpu-host/build_bundle.sh in .bundle/ (part-a, part-b) and this
# package's wheel in .bundle/kvc/ (`pip wheel --no-deps -w .bundle/kvc .`). Each part is
# carried in its own call (64 MiB per call); /tmp/site survives while the host stays warm.
#
#   bash scripts/gpu_host.sh install-a            # call 1 (carry .bundle/part-a)
#   bash scripts/gpu_host.sh install-b            # call 2 (carry .bundle/part-b and .bundle/kvc)
#   bash scripts/gpu_host.sh unit                 # kernel/runner unit tests on the GPU (CUDA graphs too)
#   bash scripts/gpu_host.sh e2e [pytest args]    # the registered CUDA suite (real sglang, CUDA graphs)
#   bash scripts/gpu_host.sh bench [args]         # scripts/bench_overhead.py + scripts/bench_kernels.py
# Logs and results go to $OUT (the device tool's folder) or ./gpu-out.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-gpu-out}"; mkdir -p "$out"
export PYTHONPATH="/tmp/site:$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step="${1:?step}"; shift || true
case "$step" in
  install-a) bash .bundle/part-a/install.sh; nvidia-smi -L; python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' ;;
  install-b)
    bash .bundle/part-b/install.sh
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .bundle/kvc/*.whl
    python3 -c 'import sglang, kv_canary.sglang_plugin as p; print("sglang", sglang.__version__, "gate:", p.version_gate() or "ok")' ;;
  unit) python3 -m pytest -q -rs test/unit -p no:cacheprovider 2>&1 | tee "$out/gpu-unit.log" ;;
  e2e) python3 scripts/run_suite.py --hw cuda -- -p no:cacheprovider -s "$@" 2>&1 | tee "$out/gpu-e2e.log" ;;
  bench)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu-info.txt"
    python3 scripts/bench_kernels.py --out "$out/bench_kernels.json" 2>&1 | tee "$out/bench-kernels.log"
    python3 scripts/bench_overhead.py --out "$out/bench_overhead.json" "$@" 2>&1 | tee "$out/bench-overhead.log" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
