#!/usr/bin/env bash
# The main job on the bundled default: a real sglang 0.5.12 server on CPU (tiny model)
# with --kv-canary on, a workload, and what the canary verified and caught.
#   bash scripts/demo.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$KVC_ROOT"
exec "$KVC_PY" scripts/demo.py "$@"
