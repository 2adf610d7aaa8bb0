#!/usr/bin/env bash
# sglang-kernel's FA3 extension (sgl_kernel/flash_ops.abi3.so) for the GPU host, which the line bundles leave out
# (bundle_lib.sh's bundle_kernel_sm90: 1,070 MB unpacked). Needed by `--attention-backend fa3` only: sglang bug
# #24097's GPU workload (test_e2e_real_bugs_gpu_more.py), which skips naming this add-on where it is missing.
#
#   scripts/build_fa3_addon.sh DEST            # sglang 0.5.12's sglang-kernel (0.4.2.post2): DEST/fa3-1 .. fa3-N
#   KVC_GPU_LINE=0.5.23 scripts/build_fa3_addon.sh DEST    # sglang 0.5.23's (0.4.10)
#
# The library is gzip'd (~326 MB) and cut into parts of 40 MiB: one upload each, with the ~10 MiB working tree,
# under the 64 MiB an upload may carry (56 MiB parts went over it). Every part carries N_PARTS, the library's SHA256
# and its version. On the host (scripts/gpu_host.sh, after the line's install): stage-fa3 N per part (back to back:
# /tmp survives 30 s), then install-fa3 joins, checks the sum and puts the library into the line's site (/tmp/site or
# /tmp/site23) beside the trimmed sgl_kernel.
set -euo pipefail
dest="${1:?usage: build_fa3_addon.sh DEST}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bundle_lib.sh
source "$here/bundle_lib.sh"
case "${KVC_GPU_LINE:-0.5.12}" in
  0.5.12) req="sglang-kernel==0.4.2.post2" ;;
  0.5.23) req="sglang-kernel==0.4.10" ;;
  *) echo "KVC_GPU_LINE=${KVC_GPU_LINE}: the FA3 add-on is built for 0.5.12 or 0.5.23" >&2; exit 2 ;;
esac
mkdir -p "$dest"; dest="$(cd "$dest" && pwd)"
t="$(mktemp -d)"; trap 'rm -rf "$t"' EXIT
bundle_download "$t/w" "$req"
(cd "$t" && python3 -m zipfile -e w/sglang_kernel-*.whl k >/dev/null)
so="$t/k/sgl_kernel/flash_ops.abi3.so"
[ -f "$so" ] || { echo "no sgl_kernel/flash_ops.abi3.so in $req" >&2; exit 1; }
sum="$(sha256sum "$so" | cut -d' ' -f1)"
gzip -c -6 "$so" > "$t/flash_ops.so.gz"
rm -rf "$dest"/fa3-[0-9]*
(cd "$t" && split -b 40M -d -a 2 flash_ops.so.gz piece.)
n=$(ls "$t"/piece.* | wc -l); i=0
for p in "$t"/piece.*; do
  i=$((i + 1)); mkdir -p "$dest/fa3-$i"; mv "$p" "$dest/fa3-$i/"
  echo "$n" > "$dest/fa3-$i/N_PARTS"; echo "$sum" > "$dest/fa3-$i/SO_SHA256"; echo "$req" > "$dest/fa3-$i/REQ"
done
echo "FA3 add-on of $req: $n parts in $dest/fa3-1 .. fa3-$n (flash_ops.abi3.so sha256 $sum)"
