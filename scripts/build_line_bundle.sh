#!/usr/bin/env bash
# Offline wheel bundle that lets a newer sglang line run on the GPU host (torch 2.11 + triton 3.6, Python 3.12,
# no package index), in place of the 0.5.12 bundle of build_bundle.sh: that bundle's wheels
# (gpu_host_wheels_0.5.12.txt, what the host lacks) with the line's own pins where they differ. Lines the host
# loads as they are pin torch 2.11.0; 0.5.17 is the newest (0.5.23: build_l23_bundle.sh).
#
#   scripts/build_line_bundle.sh 0.5.17 DEST     (DEST: a folder git ignores; scripts/gpu_host.sh bundle uses .bundle)
#
# Produces DEST/line-a and DEST/line-b (~56 MiB each for 0.5.17: one upload each, with the working tree and the plugin
# wheel), each with an install.sh that installs into /tmp/site like build_bundle.sh's parts.
# sglang-kernel is trimmed to the sm90 (Hopper) build as there (bundle_lib.sh).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bundle_lib.sh
source "$here/bundle_lib.sh"
line="${1:?usage: build_line_bundle.sh LINE DEST}"
dest="${2:?usage: build_line_bundle.sh LINE DEST}"
base_reqs="${KVC_BASE_REQUIREMENTS:-$here/gpu_host_wheels_0.5.12.txt}"
case "$line" in
  # sglang 0.5.17's pins (its wheel's Requires-Dist) that differ from the 0.5.12 bundle's; whatever else its
  # server imports at startup is in that bundle or on the host (checked by importing its server modules in a
  # 0.5.17 venv and comparing with 0.5.12's)
  # 0.5.17's server imports xgrammar unconditionally (function_call/inkling_detector.py), 0.5.12's did not: its wheel
  # ships a 65 MB static library (xgrammar/lib) that nothing loads at run time, left out here
  0.5.17) pins=("sglang==0.5.17" "apache-tvm-ffi==0.1.11" "transformers==5.12.1" "flashinfer-python==0.6.15.post1")
          kernel="sglang-kernel==0.4.5"; xgrammar="xgrammar==0.2.1" ;;
  *) echo "build_line_bundle: no GPU-host bundle for sglang $line (lines the host loads: 0.5.17)" >&2; exit 2 ;;
esac
[ -f "$base_reqs" ] || { echo "build_line_bundle: $base_reqs not found (set KVC_BASE_REQUIREMENTS)" >&2; exit 2; }
mapfile -t reqs < <(bundle_requirements "$base_reqs" "" "${pins[@]}")
rm -rf "$dest/line-a" "$dest/line-b" "$dest/line-wheels"; mkdir -p "$dest/line-a" "$dest/line-b"
bundle_download "$dest/line-wheels" "${reqs[@]}"
bundle_kernel_sm90 "$kernel" "$dest/line-b/sgl_kernel_sm90.tgz"
if [ -n "${xgrammar:-}" ]; then
  tmp="$(mktemp -d)"
  bundle_download "$tmp" "$xgrammar"
  (cd "$tmp" && python3 -m zipfile -e xgrammar-*.whl x >/dev/null)
  rm -rf "$tmp/x/xgrammar/lib"
  tar czf "$dest/line-a/xgrammar.tgz" -C "$tmp/x" .
  rm -rf "$tmp"
fi
bundle_split_two "$dest/line-wheels" "$dest/line-a" "$dest/line-b"  # two parts of similar size, largest first
for part in line-a line-b; do bundle_site_installer "$dest/$part" /tmp/site "sglang $line bundle"; done
du -sh "$dest/line-a" "$dest/line-b"
