#!/usr/bin/env bash
# Shared steps of the GPU-host bundle builders (build_bundle.sh, build_line_bundle.sh, build_l23_bundle.sh), sourced:
# wheels for the host (CPython 3.12, x86-64 manylinux), sglang-kernel trimmed to its sm90 (Hopper) build, a base
# requirements list with a line's own pins, parts of similar size, and the install.sh a part carries.

# bundle_download DIR REQ...: the wheels of REQ (no deps, binary only) for the host, into DIR
bundle_download() {
  local d="$1" plat=() v; shift
  for v in 34 31 28 27 24 18 17; do plat+=(--platform "manylinux_2_${v}_x86_64"); done
  plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
  mkdir -p "$d"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$d" "$@" > "$d/.log" 2>&1 || { grep -v "^WARNING: Location" "$d/.log" >&2; return 1; }
  rm -f "$d/.log"
}

# bundle_kernel_sm90 REQ OUT_TGZ: sglang-kernel REQ unpacked with only what Hopper loads (sgl_kernel's Python, sm90/,
# the other op libraries it probes, its dist-info), packed as OUT_TGZ for untarring into a site folder. Left out:
# sm100/, FA3 (flash_ops), flashmla_ops, infllm_ops, triton_kernels/, the CUDA libraries and headers it ships.
bundle_kernel_sm90() {
  local req="$1" out="$2" t
  t="$(mktemp -d)"
  bundle_download "$t" "$req" || { rm -rf "$t"; return 1; }
  (cd "$t" && python3 -m zipfile -e sglang_kernel-*.whl k >/dev/null)
  rm -rf "$t/k/sgl_kernel/sm100" "$t/k/sgl_kernel/flash_ops.abi3.so" "$t/k/sgl_kernel/flashmla_ops.abi3.so" \
         "$t/k/sgl_kernel"/infllm_ops.*.so "$t/k/lib" "$t/k/include" "$t/k/lib64" "$t/k/triton_kernels" \
         "$t/k"/_mscclpp*.so
  [ -f "$t/k/sgl_kernel/sm90/common_ops.abi3.so" ] || { echo "no sm90/common_ops in $req" >&2; rm -rf "$t"; return 1; }
  tar czf "$out" -C "$t/k" .
  rm -rf "$t"
}

# bundle_requirements BASE_FILE "DROP..." PIN...: PIN..., then BASE_FILE's requirements (comments and blank lines
# skipped) whose project neither a PIN nor DROP names, one a line
bundle_requirements() {
  local base="$1" drop="$2" skip=" " p req; shift 2
  [ -f "$base" ] || { echo "base requirements $base not found" >&2; return 2; }
  for p in $drop "$@"; do skip+="$(_bundle_project "$p") "; done
  for p in "$@"; do echo "$p"; done
  grep -v '^#' "$base" | grep . | while read -r req; do
    [[ "$skip" == *" $(_bundle_project "$req") "* ]] || echo "$req"
  done
}
_bundle_project() { echo "${1%%==*}" | tr '[:upper:]_' '[:lower:]-'; }

# bundle_split_two SRC A B: move SRC's files into folders A and B, largest first, each to the lighter one (what A
# and B already hold counts); SRC is removed
bundle_split_two() {
  local src="$1" a="$2" b="$3" sa=0 sb=0 f s
  mkdir -p "$a" "$b"
  sa=$(du -sb "$a" | cut -f1); sb=$(du -sb "$b" | cut -f1)
  for f in $(ls -S "$src"); do
    s=$(stat -c %s "$src/$f")
    if [ "$sa" -le "$sb" ]; then mv "$src/$f" "$a/"; sa=$((sa + s)); else mv "$src/$f" "$b/"; sb=$((sb + s)); fi
  done
  rmdir "$src"
}

# bundle_site_installer PART SITE LABEL: PART/install.sh, which pip-installs PART's wheels (no index, no deps) and
# untars its .tgz files into SITE on the host (idempotent)
bundle_site_installer() {
  local part="$1" site="$2" label="$3"
  cat > "$part/install.sh" <<INNER
#!/usr/bin/env bash
# Install this part of the $label into $site (idempotent).
set -euo pipefail
here="\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)"
mkdir -p $site
shopt -s nullglob
whls=("\$here"/*.whl)
[ \${#whls[@]} -eq 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
  --target $site "\${whls[@]}"
for t in "\$here"/*.tgz; do tar xzf "\$t" -C $site; done
echo "installed \$here into $site ($label)"
INNER
  chmod +x "$part/install.sh"
}
