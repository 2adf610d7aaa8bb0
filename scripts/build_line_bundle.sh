#!/usr/bin/env bash
# Offline wheel bundle that lets a newer sglang line run on the GPU host (torch 2.11 + triton 3.6, Python 3.12,
# no package index), in place of the 0.5.12 bundle of ../shared/gpu-host/build_bundle.sh: that bundle's pins
# (requirements-gpu.txt, the wheels the host lacks) with the line's own pins where they differ. Lines the host
# can load pin torch 2.11.0; 0.5.17 is the newest.
#
#   scripts/build_line_bundle.sh 0.5.17 DEST     (DEST: a folder git ignores; scripts/gpu_host.sh bundle uses .bundle)
#
# Produces DEST/line-a and DEST/line-b (each under ~50 MiB: one upload each, with the working tree and the plugin
# wheel), each with an install.sh that installs into /tmp/site like build_bundle.sh's parts.
# sglang-kernel is trimmed to the sm90 (Hopper) build as there.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
line="${1:?usage: build_line_bundle.sh LINE DEST}"
dest="${2:?usage: build_line_bundle.sh LINE DEST}"
base_reqs="${KVC_BASE_REQUIREMENTS:-$here/../../shared/gpu-host/requirements-gpu.txt}"
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
norm() { echo "${1%%==*}" | tr '[:upper:]_' '[:lower:]-'; }
overridden=" "; for p in "${pins[@]}"; do overridden+="$(norm "$p") "; done
reqs=("${pins[@]}")
while read -r req; do
  [[ "$overridden" == *" $(norm "$req") "* ]] || reqs+=("$req")
done < <(grep -v '^#' "$base_reqs" | grep .)
plat=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform any)
download() {  # download DIR REQ
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$1" "$2" > "$1/.log" 2>&1 || { grep -v "^WARNING: Location" "$1/.log" >&2; exit 1; }
  rm -f "$1/.log"
}
rm -rf "$dest/line-a" "$dest/line-b" "$dest/line-wheels"; mkdir -p "$dest/line-a" "$dest/line-b" "$dest/line-wheels"
for req in "${reqs[@]}"; do download "$dest/line-wheels" "$req"; done
tmp="$(mktemp -d)"
download "$tmp" "$kernel"
(cd "$tmp" && python3 -m zipfile -e sglang_kernel-*.whl x >/dev/null)
rm -rf "$tmp/x/sgl_kernel/sm100" "$tmp/x/sgl_kernel/flash_ops.abi3.so" "$tmp/x/sgl_kernel/flashmla_ops.abi3.so" \
       "$tmp/x/sgl_kernel"/infllm_ops.*.so "$tmp/x/lib" "$tmp/x/include" "$tmp/x/lib64" "$tmp/x/triton_kernels" \
       "$tmp/x"/_mscclpp*.so
tar czf "$dest/line-b/sgl_kernel_sm90.tgz" -C "$tmp/x" .
rm -rf "$tmp"
if [ -n "${xgrammar:-}" ]; then
  tmp="$(mktemp -d)"
  download "$tmp" "$xgrammar"
  (cd "$tmp" && python3 -m zipfile -e xgrammar-*.whl x >/dev/null)
  rm -rf "$tmp/x/xgrammar/lib"
  tar czf "$dest/line-a/xgrammar.tgz" -C "$tmp/x" .
  rm -rf "$tmp"
fi
# two parts of similar size, largest first
a=0; for t in "$dest/line-a"/*.tgz; do [ -f "$t" ] && a=$((a + $(stat -c %s "$t"))); done
b=$(stat -c %s "$dest/line-b/sgl_kernel_sm90.tgz")
for w in $(ls -S "$dest/line-wheels"); do
  s=$(stat -c %s "$dest/line-wheels/$w")
  if [ "$a" -le "$b" ]; then mv "$dest/line-wheels/$w" "$dest/line-a/"; a=$((a + s))
  else mv "$dest/line-wheels/$w" "$dest/line-b/"; b=$((b + s)); fi
done
rmdir "$dest/line-wheels"
for part in line-a line-b; do
  cat > "$dest/$part/install.sh" <<INNER
#!/usr/bin/env bash
# Install this part of the sglang $line bundle into /tmp/site (idempotent).
set -euo pipefail
here="\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)"
mkdir -p /tmp/site
shopt -s nullglob
whls=("\$here"/*.whl)
[ \${#whls[@]} -eq 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
  --target /tmp/site "\${whls[@]}"
for t in "\$here"/*.tgz; do tar xzf "\$t" -C /tmp/site; done
echo "installed \$here into /tmp/site (sglang $line bundle)"
INNER
  chmod +x "$dest/$part/install.sh"
done
du -sh "$dest/line-a" "$dest/line-b"
