#!/usr/bin/env bash
# One upload that lets an sglang release between the GPU host's lines run there (issue 58 step 5): only what the
# release pins differently from the 0.5.12 bundle of build_bundle.sh (sglang itself, sglang-kernel trimmed to sm90,
# flashinfer, transformers, apache-tvm-ffi), installed into its own folder /tmp/site-<release> that goes in front
# of /tmp/site. Releases the host loads as they are (torch 2.11.0) and that import nothing else new at startup:
#
#   scripts/build_release_overlay.sh 0.5.14 DEST   # DEST/rel-0.5.14 (~51 MiB: one upload with the working tree)
#
# On the host, after install-a and install-b: `bash scripts/gpu_host.sh install-rel 0.5.14` (carry .bundle/rel-0.5.14),
# then any step with KVC_GPU_RELEASE=0.5.14 (PYTHONPATH /tmp/site-0.5.14:/tmp/site); the plugin's wheel in /tmp/site
# picks the release's line itself.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bundle_lib.sh
source "$here/bundle_lib.sh"
release="${1:?usage: build_release_overlay.sh RELEASE DEST}"
dest="${2:?usage: build_release_overlay.sh RELEASE DEST}/rel-$release"
case "$release" in
  # each release's Requires-Dist that differ from 0.5.12's and that its server imports on a GPU (the others:
  # sgl-deep-gemm, tilelang, tokenspeed_mla, flash-attn-4, cutlass-dsl are not reached by a triton-attention server)
  0.5.14) pins=("sglang==0.5.14" "flashinfer-python==0.6.12" "transformers==5.8.1") ;;
  0.5.15) pins=("sglang==0.5.15" "flashinfer-python==0.6.12" "transformers==5.12.1" "apache-tvm-ffi==0.1.11") ;;
  *) echo "build_release_overlay: no overlay for sglang $release (have: 0.5.14, 0.5.15)" >&2; exit 2 ;;
esac
kernel="sglang-kernel==0.4.4"  # 0.5.14 and 0.5.15
rm -rf "$dest"; mkdir -p "$dest"
bundle_download "$dest" "${pins[@]}"
bundle_kernel_sm90 "$kernel" "$dest/sgl_kernel_sm90.tgz"
bundle_site_installer "$dest" "/tmp/site-$release" "sglang $release overlay"
du -sh "$dest"
