#!/usr/bin/env bash
# The main job on the bundled default: a real sglang server on CPU (tiny model; KVC_SGLANG=0.5.23 by default, or 0.5.12)
# with --kv-canary on, a workload, and what the canary verified and caught.
#   bash scripts/demo.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$KVC_ROOT"
exec "$KVC_PY" scripts/demo.py "$@"
