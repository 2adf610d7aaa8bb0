#!/usr/bin/env bash
# PD-disaggregation extras for the GPU host (issue 25): the CUDA build of mooncake's transfer engine, sglang-router
# (the PD e2e's mini load balancer: PDCluster runs `sglang_router.launch_router --mini-lb`) and the Ubuntu libraries
# mooncake's engine.so links, in parts that each fit one upload with the working tree.
#
#   scripts/build_pd_bundle.sh DEST     (DEST: a folder git ignores; scripts/gpu_host.sh bundle-pd uses .bundle)
#
# Produces DEST/pd-1 .. DEST/pd-N (N = 3 today: 45 + 45 + ~45 MiB). A wheel larger than a part travels split
# (split -b 45M) and is joined on the host. Every part carries install.sh and SHA256SUMS (of every part file and of
# every joined wheel). On the host (scripts/gpu_host.sh install-pd-part N, install-pd): copy each part into
# /tmp/pd-parts (one call each, back to back: /tmp survives 30 s), then install.sh joins, checks the sums,
# pip-installs the wheels into /tmp/site, unpacks the debs (dpkg -x) into /tmp/pd-libs/root and links into
# /tmp/pd-libs/lib the libraries the host lacks (the folder to put on LD_LIBRARY_PATH).
#
# Wheels (KVC_PD_WHEELS): mooncake-transfer-engine-cuda13==0.3.13.post1, the CUDA 13 build (98 MB; same release as
# the CPU CI's -non-cuda build): the host's torch is 2.11.0+cu130 and this engine.so links libcudart.so.13, which
# torch brings. The CUDA 12 build (mooncake-transfer-engine==0.3.13.post1, also 98 MB) links libcudart.so.12, which
# the host lacks: to use it, add nvidia-cuda-runtime-cu12 to KVC_PD_WHEELS (install.sh finds its libcudart there).
# Debs (KVC_PD_DEBS): engine.so's NEEDED beyond glibc/libstdc++/CUDA are libibverbs.so.1, libmlx5.so.1
# (ibverbs-providers), libnuma.so.1 and libcurl.so.4; the list is their run-time closure, minus glibc, libgcc,
# libstdc++ (librdmacm too, as on the CPU machine). From Ubuntu 24.04 (noble): the host's python3 is 3.12.3,
# noble's (a guess: nothing states its OS). apt fetches them over HTTPS from archive.ubuntu.com with its own state
# under DEST/pd-apt, the archive key from noble's ubuntu-keyring package (same origin, HTTPS).
set -euo pipefail
dest="${1:?usage: build_pd_bundle.sh DEST}"
mkdir -p "$dest"; dest="$(cd "$dest" && pwd)"
# shellcheck disable=SC2206
wheels=(${KVC_PD_WHEELS:-mooncake-transfer-engine-cuda13==0.3.13.post1 sglang-router==0.3.2})
# shellcheck disable=SC2206
debs=(${KVC_PD_DEBS:-libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 librdmacm1t64 libnuma1
  libcurl4t64 libbrotli1 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libidn2-0
  libunistring5 libldap2 libsasl2-2 libsasl2-modules-db libdb5.3t64 libgnutls30t64 libhogweed6t64 libnettle8t64
  libgmp10 libp11-kit0 libffi8 libtasn1-6 libnghttp2-14 libpsl5t64 librtmp1 libssh-4 libssl3t64 libzstd1 zlib1g})
part_bytes=$((45 * 1048576))
src="$dest/pd-src"; apt_dir="$dest/pd-apt"
rm -rf "$src" "$dest"/pd-[0-9]*; mkdir -p "$src/wheels" "$src/debs" "$apt_dir"

# -- wheels
for req in "${wheels[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$src/wheels" "$req" > "$src/.log" 2>&1 \
    || { grep -v "^WARNING: Location" "$src/.log" >&2; exit 1; }
done
rm -f "$src/.log"

# -- debs (noble), apt with a private state folder
keyring="$apt_dir/ubuntu-archive-keyring.gpg"
if [ ! -s "$keyring" ]; then
  curl -fsS --max-time 120 -o "$apt_dir/ubuntu-keyring.deb" \
    https://archive.ubuntu.com/ubuntu/pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb
  dpkg -x "$apt_dir/ubuntu-keyring.deb" "$apt_dir/kr"
  cp "$apt_dir/kr/usr/share/keyrings/ubuntu-archive-keyring.gpg" "$keyring"
fi
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
for suite in noble noble-updates; do
  echo "deb [arch=amd64 signed-by=$keyring] https://archive.ubuntu.com/ubuntu $suite main"
done > "$apt_dir/sources.list"
apt_o=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
       -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o Dir::State::status=/dev/null
       -o APT::Architecture=amd64 -o APT::Architectures=amd64 -o Acquire::Languages=none -o APT::Sandbox::User=root)
apt-get -qq "${apt_o[@]}" update
(cd "$src/debs" && apt-get -qq "${apt_o[@]}" download "${debs[@]}")

# -- check: every NEEDED of mooncake's libraries and of the debs' is shipped or a host base library
x="$(mktemp -d)"; trap 'rm -rf "$x"' EXIT
for w in "$src"/wheels/mooncake*.whl "$src"/wheels/nvidia*.whl; do
  [ ! -e "$w" ] || python3 -m zipfile -e "$w" "$x/whl"
done
for d in "$src"/debs/*.deb; do dpkg -x "$d" "$x/root"; done
shipped=" $(find "$x" \( -name '*.so' -o -name '*.so.*' \) -printf '%f ' ) "
host_base=" $(echo libc.so.6 libm.so.6 libdl.so.2 librt.so.1 libpthread.so.0 libresolv.so.2 ld-linux-x86-64.so.2 \
  libstdc++.so.6 libgcc_s.so.1 libcuda.so.1 libcudart.so.13 libc10.so libc10_cuda.so libtorch.so libtorch_cpu.so \
  libtorch_cuda.so libtorch_python.so) "
needed="$(find "$x" -type f \( -name '*.so' -o -name '*.so.*' \) -exec readelf -d {} + 2>/dev/null \
  | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u)"
unmet=""; for so in $needed; do [[ "$shipped$host_base" == *" $so "* ]] || unmet+=" $so"; done
[ -z "$unmet" ] || { echo "build_pd_bundle: NEEDED by nothing shipped and not a host base library:$unmet" >&2; exit 1; }

# -- parts: wheels over a part's size split, then first fit, largest first
mkdir -p "$x/items"
for w in "$src"/wheels/*.whl; do
  if [ "$(stat -c %s "$w")" -gt "$part_bytes" ]; then
    split -b 45M "$w" "$x/items/$(basename "$w").part-"; echo "$(basename "$w")" >> "$x/join"
  else cp "$w" "$x/items/"; fi
done
cp "$src"/debs/*.deb "$x/items/"
(cd "$src/wheels" && sha256sum *.whl) > "$x/SHA256SUMS.wheels"
(cd "$x/items" && sha256sum *) | sed 's#  \(.*\.deb\)$#  debs/\1#' > "$x/SHA256SUMS.parts"
declare -a fill=()
for f in $(ls -S "$x/items"); do
  s=$(stat -c %s "$x/items/$f"); i=0
  while [ $i -lt ${#fill[@]} ] && [ $((fill[i] + s)) -gt $((part_bytes + 1048576)) ]; do i=$((i + 1)); done
  [ $i -lt ${#fill[@]} ] || fill[i]=0
  fill[i]=$((fill[i] + s)); p="$dest/pd-$((i + 1))"
  case "$f" in *.deb) mkdir -p "$p/debs"; cp "$x/items/$f" "$p/debs/"; echo "$((i + 1)) debs/$f" ;;
               *) mkdir -p "$p"; cp "$x/items/$f" "$p/"; echo "$((i + 1)) $f" ;; esac >> "$x/PART_OF"
done
n=${#fill[@]}
cat > "$x/install.sh" <<'INNER'
#!/usr/bin/env bash
# Join, check and install the PD extras copied beside this file (/tmp/pd-parts; written by
# scripts/build_pd_bundle.sh) into $PD_SITE (/tmp/site), their libraries into $PD_LIBS (/tmp/pd-libs).
set -euo pipefail
parts="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" site="${PD_SITE:-/tmp/site}" libs="${PD_LIBS:-/tmp/pd-libs}"
cd "$parts"
n_parts=$(cat N_PARTS)
missing=$(while read -r i f; do [ -e "$f" ] || echo "$i"; done < PART_OF | sort -u)
[ -z "$missing" ] || { echo "install-pd: part(s) $(echo $missing) of $n_parts not in $parts (not copied, or the" \
  "host went cold: then copy parts 1..$n_parts again)" >&2; exit 1; }
sha256sum -c --quiet SHA256SUMS.parts
[ ! -f JOIN ] || while read -r w; do cat "$w".part-* > "$w"; done < JOIN
sha256sum -c --quiet SHA256SUMS.wheels
mkdir -p "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  $(awk '{print $2}' SHA256SUMS.wheels)
command -v dpkg > /dev/null || { echo "install-pd: no dpkg on this host to unpack debs/" >&2; exit 1; }
rm -rf "$libs"; mkdir -p "$libs/root" "$libs/lib"
for d in debs/*.deb; do dpkg -x "$d" "$libs/root"; done
has() { ldconfig -p 2>/dev/null | grep -q "^[[:space:]]*$1 " || [ -e "/lib/x86_64-linux-gnu/$1" ] \
  || [ -e "/usr/lib/x86_64-linux-gnu/$1" ] || [ -e "/usr/lib64/$1" ]; }
linked=()
for f in "$libs"/root/lib/x86_64-linux-gnu/*.so.* "$libs"/root/usr/lib/x86_64-linux-gnu/*.so.*; do
  [ -e "$f" ] || continue
  b=$(basename "$f"); has "$b" || { ln -sf "$f" "$libs/lib/$b"; [[ ! "$b" =~ \.so\.[0-9]+$ ]] || linked+=("$b"); }
done
echo "install-pd: from the debs, linked into $libs/lib (the host lacks them): ${linked[*]:-none}"
export LD_LIBRARY_PATH="$libs/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# what engine.so still misses (libcudart.so.N: torch's, or nvidia-cuda-runtime-cu12's): link it from Python's
# site folders
eng="$site/mooncake/engine.so"
for so in $(ldd "$eng" | awk '/not found/{print $1}'); do
  roots=("$site"); for d in $(python3 -c 'import site; print(*site.getsitepackages())'); do
    [ -d "$d/nvidia" ] && roots+=("$d/nvidia"); done
  f=$(find "${roots[@]}" -name "$so" 2>/dev/null | head -1)
  [ -z "$f" ] || { ln -sf "$f" "$libs/lib/$so"; echo "install-pd: linked $f"; }
done
left=$(ldd "$eng" | awk '/not found/{print $1}')
# a warning only: the import (scripts/gpu_host.sh install-pd) decides; torch may bring a library ldd does not see
[ -z "$left" ] || echo "install-pd: WARNING: ldd finds no $(echo $left) for engine.so" >&2
echo "install-pd: export LD_LIBRARY_PATH=$libs/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
INNER
echo "$n" > "$x/N_PARTS"
for i in $(seq 1 "$n"); do
  cp "$x/install.sh" "$x/SHA256SUMS.parts" "$x/SHA256SUMS.wheels" "$x/N_PARTS" "$x/PART_OF" "$dest/pd-$i/"
  [ ! -f "$x/join" ] || cp "$x/join" "$dest/pd-$i/JOIN"
done
du -sh "$dest"/pd-[0-9]*
