#!/usr/bin/env bash
# The test suite on each supported sglang line: unit tests + every registered CPU e2e test (real sglang servers
# on CPU).
#   bash scripts/test.sh [extra pytest args]                      # both lines at once: 0.5.23 (the newest), 0.5.12
#   KVC_SGLANG=0.5.12 bash scripts/test.sh [extra pytest args]    # one line only
#   KVC_TEST_SERIAL=1 bash scripts/test.sh                        # the lines one after the other
#   KVC_TMP=/tmp/other bash scripts/test.sh                       # logs and pytest's basetemp there (default /tmp):
#                                                                  # a second run on the same machine at once
# The two lines run side by side (each in its own venv, pytest process and --basetemp; output prefixed with the
# line, and each line's log kept in $KVC_TMP/kvc-test-<line>.log, default /tmp): most of a CPU e2e test is one server's
# single-threaded startup and serving loop, so two lines share a 2-core machine at little cost to each.
# Each line runs in its own venv (scripts/setup_env.sh; both are built at once when missing). Tests of what a
# line's adapter does not verify yet are not collected there; test/conftest.py lists them, with the reason, in
# the run's header.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tmp="${KVC_TMP:-/tmp}"; mkdir -p "$tmp"
lines="${KVC_SGLANG:-0.5.23 0.5.12}"
pids=()
for line in $lines; do  # venv builds are mostly downloads: do them side by side
  KVC_SGLANG="$line" bash "$root/scripts/setup_env.sh" > "$tmp/kvc-setup-$line.log" 2>&1 & pids+=($!)
done
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then cat "$tmp"/kvc-setup-*.log >&2; echo "test.sh: setup failed" >&2; exit 1; fi
done
cat "$tmp"/kvc-setup-*.log
run_line() {  # one line's suite, in a subshell: setup_env.sh sets KVC_VENV / KVC_PY, which must not carry over
  local line="$1"; shift
  (
    # shellcheck source=/dev/null
    KVC_SGLANG="$line" source "$root/scripts/setup_env.sh" > /dev/null
    "$KVC_PY" -c "import sglang, sys; v = sglang.__version__; sys.exit(0 if v == '$line' else f'test.sh: the venv for sglang $line holds sglang {v}')"
    cd "$KVC_ROOT" && "$KVC_PY" scripts/run_suite.py --hw cpu --with-unit -- -s --basetemp="$tmp/kvc-pytest-$line" "$@"
  )
}
status=0
if [ "${KVC_TEST_SERIAL:-0}" = 1 ] || [ "$(wc -w <<< "$lines")" -eq 1 ]; then
  for line in $lines; do
    echo "=== sglang $line ==="
    run_line "$line" "$@" || status=1
  done
  exit $status
fi
start=$SECONDS
for line in $lines; do rm -f "$tmp/kvc-test-$line.rc"; done
for line in $lines; do
  echo "=== sglang $line (side by side with the other lines; output prefixed [$line]) ==="
  { run_line "$line" "$@" && rc=0 || rc=$?; echo "$rc" > "$tmp/kvc-test-$line.rc"; } 2>&1 \
    | sed -u "s/^/[$line] /" | tee "$tmp/kvc-test-$line.log" &
done
wait
for line in $lines; do
  rc="$(cat "$tmp/kvc-test-$line.rc" 2>/dev/null || echo missing)"
  echo "=== sglang $line: rc=$rc; $(grep -E '^\[[0-9.]+\] =+ .*(passed|failed|error).* in ' "$tmp/kvc-test-$line.log" | tail -1 | sed 's/^\[[0-9.]*\] //')"
  [ "$rc" = 0 ] || status=1
done
echo "=== both lines in $((SECONDS - start)) s ==="
exit $status
