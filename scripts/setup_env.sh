#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv for one sglang release line and install the plugin into it.
#
#   KVC_SGLANG=0.5.23 source scripts/setup_env.sh   # sets KVC_PY to the venv's python (default line: 0.5.23)
#   KVC_SGLANG=0.5.12 source scripts/setup_env.sh
#   KVC_SGLANG=0.5.17 source scripts/setup_env.sh   # the newest release the GPU host can run (torch 2.11)
#   KVC_SGLANG=0.5.18 source scripts/setup_env.sh   # or 0.5.19-0.5.21: torch 2.13.0, for release_matrix.py
#
# The venv lives outside the checkout ($KVC_VENV, default
# ~/.cache/sglang-kv-canary/venv-<hash>), keyed by a hash of the dependency pins
# below, so CI and later runs reuse it; it is built from nothing when absent
# (each line pulls a CUDA build of torch: 0.5.12 torch 2.11, ~9 GB, ~5 min; 0.5.23 torch 2.14.1, ~10 min).
# The plugin itself is (re)installed editable every time (seconds, no download, no dependency change).
set -euo pipefail
kvc_pip() {  # pip, quiet unless it fails (this machine's pip config adds noisy local-index warnings)
  local log; log="$(mktemp)"
  if ! "$@" > "$log" 2>&1; then grep -v "^WARNING: Location" "$log" | tail -40; rm -f "$log"; return 1; fi
  rm -f "$log"
}
KVC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVC_SGLANG="${KVC_SGLANG:-0.5.23}"
KVC_NODEPS=""
case "$KVC_SGLANG" in
  0.5.12) KVC_DEPS=("sglang==0.5.12" "kernels==0.14.1" "torch==2.11.0") ;;
  0.5.17) KVC_DEPS=("sglang==0.5.17") ;;  # pins torch 2.11.0 (the GPU host's), kernels 0.14.1
  0.5.23) KVC_DEPS=("sglang==0.5.23") ;;  # pins torch 2.14.1, kernels<0.15
  # 0.5.18-0.5.21 pin cuda-tile==1.6.0rc5, a stub whose build downloads from an outside index, and torch==2.13.0,
  # which resolves to 2.13.0+cpu here (torchvision's ops then fail to load): sglang goes in --no-deps, then its own
  # requirements with those two swapped for the ones below (KVC_NODEPS; see docs/compatibility.md).
  0.5.18|0.5.19|0.5.20|0.5.21) KVC_NODEPS="sglang==$KVC_SGLANG"; KVC_DEPS=("torch===2.13.0" "cuda-tile>=1.6") ;;
  *) echo "setup_env: KVC_SGLANG=$KVC_SGLANG: supported sglang lines are 0.5.12, 0.5.17, 0.5.18-0.5.21 and 0.5.23" >&2
     return 2 2>/dev/null || exit 2 ;;
esac
KVC_DEPS+=("pytest>=8" "requests>=2.31" "hatchling>=1.25" "editables>=0.5")
KVC_PYTHON="${KVC_PYTHON:-python3}"
kvc_hash="$(printf '%s\n' ${KVC_NODEPS:+"$KVC_NODEPS"} "${KVC_DEPS[@]}" "$("$KVC_PYTHON" -c 'import sys; print(sys.version_info[:2])')" | sha256sum | cut -c1-12)"
KVC_VENV="${KVC_VENV:-$HOME/.cache/sglang-kv-canary/venv-$kvc_hash}"
if [ ! -f "$KVC_VENV/.kvc-ready" ]; then
  echo "setup_env: building $KVC_VENV (sglang $KVC_SGLANG + CUDA torch wheels; several minutes)"
  rm -rf "$KVC_VENV"
  mkdir -p "$(dirname "$KVC_VENV")"
  "$KVC_PYTHON" -m venv "$KVC_VENV"
  kvc_reqs=()
  if [ -n "${KVC_NODEPS:-}" ]; then  # the release alone, then its requirements less the pins KVC_DEPS replaces
    kvc_pip "$KVC_VENV/bin/python" -m pip install --disable-pip-version-check --no-deps "$KVC_NODEPS"
    mapfile -t kvc_reqs < <("$KVC_VENV/bin/python" -c 'import importlib.metadata as m, re
for r in m.requires("sglang"):
    if "extra ==" not in r and not re.match(r"(torch|cuda-tile)\s*==", r): print(r)')
  fi
  kvc_pip "$KVC_VENV/bin/python" -m pip install --disable-pip-version-check "${KVC_DEPS[@]}" ${kvc_reqs[@]+"${kvc_reqs[@]}"}
  "$KVC_VENV/bin/python" -c "import sglang, torch, triton, pytest, requests" # fail here, not later
  touch "$KVC_VENV/.kvc-ready"
else
  echo "setup_env: reusing $KVC_VENV"
fi
# PD-disaggregation extras (mooncake transfer engine, sglang's router), on the lines PD is verified on (0.5.12,
# 0.5.23): a separate guarded step with its own marker, so the base venv (and its hash) stays as it is. mooncake's
# import needs Debian's ibverbs/rdmacm/numa.
KVC_EXTRAS=("mooncake-transfer-engine-non-cuda==0.3.13.post1" "sglang-router==0.3.2")
KVC_APT=(libibverbs1 librdmacm1 libnuma1)
kvc_extras_marker="$KVC_VENV/.kvc-extras-$(printf '%s\n' "${KVC_EXTRAS[@]}" "${KVC_APT[@]}" | sha256sum | cut -c1-12)"
kvc_apt_missing() {
  local pkg missing=()
  for pkg in "${KVC_APT[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  echo "${missing[@]}"
}
if { [ "$KVC_SGLANG" = 0.5.12 ] || [ "$KVC_SGLANG" = 0.5.23 ]; } && { [ ! -f "$kvc_extras_marker" ] || [ -n "$(kvc_apt_missing)" ]; }; then
  missing="$(kvc_apt_missing)"
  if [ -n "$missing" ]; then
    echo "setup_env: installing Debian packages for the PD extras: $missing"
    kvc_sudo=""; [ "$(id -u)" = 0 ] || kvc_sudo="sudo"
    # shellcheck disable=SC2086
    kvc_pip $kvc_sudo apt-get update -qq
    # shellcheck disable=SC2086
    kvc_pip $kvc_sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing
  fi
  if [ ! -f "$kvc_extras_marker" ]; then
    echo "setup_env: installing the PD extras: ${KVC_EXTRAS[*]}"
    kvc_pip "$KVC_VENV/bin/python" -m pip install --disable-pip-version-check "${KVC_EXTRAS[@]}"
    "$KVC_VENV/bin/python" -c "import mooncake.engine, sglang_router.launch_router"  # fail here, not later
    touch "$kvc_extras_marker"
  fi
fi
kvc_pip "$KVC_VENV/bin/python" -m pip install --disable-pip-version-check --no-deps --no-build-isolation -e "$KVC_ROOT"
"$KVC_VENV/bin/python" -c "import kv_canary.sglang_plugin, kv_canary_testing"
KVC_PY="$KVC_VENV/bin/python"
export KVC_PY KVC_ROOT KVC_SGLANG
