#!/usr/bin/env bash
# The test suite: unit tests + every registered CPU e2e test (real sglang 0.5.12 servers on CPU).
#   bash scripts/test.sh [extra pytest args]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$KVC_ROOT"
exec "$KVC_PY" scripts/run_suite.py --hw cpu --with-unit -- -s "$@"  # -s: show the e2e result lines
