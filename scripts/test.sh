#!/usr/bin/env bash
# The test suite on each supported sglang line: unit tests + every registered CPU e2e test (real sglang servers
# on CPU).
#   bash scripts/test.sh [extra pytest args]                      # both lines: 0.5.23 (the newest), then 0.5.12
#   KVC_SGLANG=0.5.12 bash scripts/test.sh [extra pytest args]    # one line only
# Each line runs in its own venv (scripts/setup_env.sh; both are built at once when missing). Tests of what a
# line's adapter does not verify yet are not collected there; test/conftest.py lists them, with the reason, in
# the run's header.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lines="${KVC_SGLANG:-0.5.23 0.5.12}"
pids=()
for line in $lines; do  # venv builds are mostly downloads: do them side by side
  KVC_SGLANG="$line" bash "$root/scripts/setup_env.sh" > "/tmp/kvc-setup-$line.log" 2>&1 & pids+=($!)
done
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then cat /tmp/kvc-setup-*.log >&2; echo "test.sh: setup failed" >&2; exit 1; fi
done
cat /tmp/kvc-setup-*.log
status=0
for line in $lines; do
  echo "=== sglang $line ==="
  # each line in a subshell: setup_env.sh sets KVC_VENV / KVC_PY, which must not carry over to the next line
  (
    # shellcheck source=/dev/null
    KVC_SGLANG="$line" source "$root/scripts/setup_env.sh" > /dev/null
    "$KVC_PY" -c "import sglang, sys; v = sglang.__version__; sys.exit(0 if v == '$line' else f'test.sh: the venv for sglang $line holds sglang {v}')"
    cd "$KVC_ROOT" && "$KVC_PY" scripts/run_suite.py --hw cpu --with-unit -- -s "$@"
  ) || status=1
done
exit $status
