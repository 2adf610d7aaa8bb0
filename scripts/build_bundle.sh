#!/usr/bin/env bash
# Offline bundles for the GPU host (torch 2.11 + triton 3.6, Python 3.12, x86-64, no package index): sglang 0.5.12,
# and upstream sglang 0.5.14 (with its in-tree canary) for side-by-side runs.
#
#   scripts/build_bundle.sh DEST              # DEST/part-a, DEST/part-b: sglang 0.5.12 (each < 60 MiB: one upload)
#   scripts/build_bundle.sh --upstream DEST   # DEST/upstream: what 0.5.14 needs beyond that bundle (~51 MiB)
#
# (DEST: a folder git ignores; scripts/gpu_host.sh bundle uses .bundle.) On the host: bash DEST/part-a/install.sh,
# then bash DEST/part-b/install.sh (one call each, same warm host), both into /tmp/site; the upstream part into
# /tmp/site-upstream (PYTHONPATH=/tmp/site-upstream:/tmp/site; it needs --disable-piecewise-cuda-graph, and this
# project's plugin, if installed, sees sglang 0.5.14 and stays inactive). The 0.5.12 wheels:
# gpu_host_wheels_0.5.12.txt; sglang-kernel is trimmed to its sm90 build (bundle_lib.sh: 322 MB whole).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bundle_lib.sh
source "$here/bundle_lib.sh"
if [ "${1:-}" = --upstream ]; then
  dest="${2:?usage: build_bundle.sh --upstream DEST}/upstream"
  rm -rf "$dest"; mkdir -p "$dest"
  bundle_download "$dest" sglang==0.5.14 flashinfer-python==0.6.12 transformers==5.8.1
  bundle_kernel_sm90 "sglang-kernel==0.4.4" "$dest/sgl_kernel_sm90.tgz"
  bundle_site_installer "$dest" /tmp/site-upstream "upstream sglang 0.5.14 bundle"
  du -sh "$dest"; exit 0
fi
dest="${1:?usage: build_bundle.sh DEST}"
rm -rf "$dest/part-a" "$dest/part-b" "$dest/wheels"; mkdir -p "$dest/part-a" "$dest/part-b"
mapfile -t reqs < <(bundle_requirements "$here/gpu_host_wheels_0.5.12.txt" "")
bundle_download "$dest/wheels" "${reqs[@]}"
bundle_kernel_sm90 "sglang-kernel==0.4.2.post2" "$dest/part-b/sgl_kernel_sm90.tgz"
bundle_split_two "$dest/wheels" "$dest/part-a" "$dest/part-b"
for part in part-a part-b; do bundle_site_installer "$dest/$part" /tmp/site "sglang 0.5.12 bundle"; done
du -sh "$dest/part-a" "$dest/part-b"
