#!/usr/bin/env bash
# Offline bundle that lets sglang 0.5.23 run on the GPU host (torch 2.11 + triton 3.6 + CUDA 13 libraries, Python
# 3.12, no package index), in numbered parts that each travel in one upload with the working tree.
#
#   scripts/build_l23_bundle.sh DEST    (DEST: a folder git ignores; scripts/gpu_host.sh bundle uses .bundle)
#   scripts/build_l23_bundle.sh --stamp (what the parts' MARK holds: gpu_host.sh bundle rebuilds when it changed)
#
# Produces DEST/l23-1 .. DEST/l23-N (each at most KVC_L23_PART_MIB, 50 MiB: the tree is ~9 MiB on 2026-12-01 and grows
# with the results, and an upload is at most 64 MiB). A wheel larger than a part travels split (pieces of a part's
# size) and is joined on the host. Every part carries install.sh, SHA256SUMS.parts (of every piece and file),
# SHA256SUMS.wheels (of every whole wheel), PART_OF, JOIN and N_PARTS. On the host (scripts/gpu_host.sh stage-l23 N,
# install-l23): copy each part into /tmp/l23-parts (one call each, back to back), then install.sh checks the sums,
# joins, checks again and pip-installs everything (--no-index --no-deps) into /tmp/site23, and unpacks the trimmed
# sglang-kernel there.
#
# What is carried (checked 2026-11-29 against a CPU venv of sglang 0.5.23, by importing the server's modules -- the
# HTTP server, tokenizer / detokenizer managers, scheduler, model runner, the triton / flashinfer / torch_native
# attention backends, llama / qwen2 / qwen3 / qwen3_next / minicpm3 / mimo models, EAGLE v2, the xgrammar backend,
# the decode CUDA graph runner -- once as on CPU and once with CUDA faked (sm90, the libcuda stub), and mapping
# sys.modules to distributions):
# - torch 2.14.1 (0.5.23's pin) and nvidia-nccl-cu13 2.30.7 (torch 2.14.1's pin: the host's NCCL lacks
#   ncclCommResume), both in the same folder (torch preloads the nvidia/*/lib it finds first on sys.path):
#   the host checks of 2026-11-28 (docs/results/gpu-h200-2026-11-29-sglang-0.5.23-first-run). torchvision 0.29.1: transformers imports torchvision when it is there,
#   and the host's 0.26.0 is built for torch 2.11. torchaudio 2.11.0: 0.5.23's pin, the host's version too
#   (abi3, 1.7 MB), carried so the set is the one 0.5.23 resolved.
# - every wheel of the 0.5.12 bundle (gpu_host_wheels_0.5.12.txt: the wheels the host lacks, verified on an H200) at the
#   version 0.5.23 resolved (the pins below), less torchao and email-validator (not in 0.5.23's resolution; torchao
#   0.17 is built for torch 2.11), plus transformers 5.19.0 and tokenizers 0.23.2 (0.5.23's exact pins; the host
#   has transformers 5.17.0, tokenizers 0.23.2), xgrammar 0.2.7 (1.3 MB, whole) and flashinfer-python 0.7.2 (65 MB:
#   split).
# - sglang-kernel 0.4.10 (373 MB) trimmed to what Hopper needs: sgl_kernel's Python, sm90/common_ops,
#   spatial_ops and its dist-info (engine.py checks its version). Left out: flash_ops (FA3, 1.1 GB unpacked:
#   --attention-backend fa3 will not load), flashmla_ops, infllm_ops, sm100/ and triton_kernels/ (each loaded lazily
#   or probed with find_spec).
# - nvidia-cutlass-dsl 4.8.0 with its base, core and cu13 libraries (~97 MB; not libs-cu12, which its metadata also
#   names) and sgl-flash-mla 1.0.0 (10 MB): imported unguarded on CUDA, missed by the check above because the tiny
#   models do not reach them -- llama.py / qwen2.py's MLP builds a DualGemm, whose mode selection imports
#   cutedsl_dual_gemm (`import cutlass`), and EAGLEWorkerV2's draft graph capture imports flashmla_backend
#   (`import flash_mla`); found on an H200 2026-11-29 (the Llama-3-8B-shaped bench servers and the EAGLE e2e died at
#   startup). cutlass lives under nvidia_cutlass_dsl/dsl_packages, put on sys.path by a .pth file that PYTHONPATH
#   folders do not run: gpu_host.sh adds that folder to PYTHONPATH.
# Imported at startup but left out, each import guarded (try/except or find_spec) in 0.5.23 or flashinfer:
# flash-attn-4, nvidia-cudnn-frontend (only behind cutlass), sgl-deep-gemm, sgl-deep-ep, torchcodec, zstandard (httpx). Not imported at startup: kernels,
# llguidance, outlines, quack-kernels, humming-kernels, tilelang, cuda-python (a meta package).
# Not carried, from the host: triton 3.6 (torch 2.14.1's METADATA asks triton~=3.8.0, 248 MB = 5 more parts; but
# every triton attribute and import named in sglang 0.5.23, flashinfer 0.7.2, xgrammar and torch 2.14.1's
# _inductor, _higher_order_ops and utils that triton 3.8 has, 3.6 has too (a static check of the attribute chains,
# resolved against both); KVC_L23_TRITON=3.8.0 carries it anyway), cuDNN 9.19 (torch wants 9.24: only cuDNN calls
# fail, see the note), tokenizers' and huggingface-hub's deps, numpy, the CUDA 13 libraries.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
l23_stamp() {  # this script, the shared steps and the base list
  echo "script $(cat "$here/build_l23_bundle.sh" "$here/bundle_lib.sh" "$here/gpu_host_wheels_0.5.12.txt" | sha256sum \
    | cut -c1-16) triton ${KVC_L23_TRITON:-host}"
}
[ "${1:-}" != --stamp ] || { l23_stamp; exit 0; }  # what a current bundle's MARK holds (gpu_host.sh bundle)
dest="${1:?usage: build_l23_bundle.sh DEST}"
mkdir -p "$dest"; dest="$(cd "$dest" && pwd)"
base_reqs="${KVC_BASE_REQUIREMENTS:-$here/gpu_host_wheels_0.5.12.txt}"
[ -f "$base_reqs" ] || { echo "build_l23_bundle: $base_reqs not found (set KVC_BASE_REQUIREMENTS)" >&2; exit 2; }
# shellcheck source=bundle_lib.sh
source "$here/bundle_lib.sh"
part_bytes=$(( ${KVC_L23_PART_MIB:-50} * 1048576 ))
meta_bytes=$((256 * 1024))  # install.sh, sums, lists: room left in every part
# 0.5.23's resolved versions of the base list's wheels where they differ, and what the base list lacks
pins=("sglang==0.5.23" "apache-tvm-ffi==0.1.11" "compressed-tensors==0.18.0" "flashinfer-python==0.7.2"
      "openai==2.8.0" "pydantic==2.14.4" "pydantic_core==2.50.5" "transformers==5.19.0" "tokenizers==0.23.2"
      "xgrammar==0.2.7" "torch==2.14.1" "nvidia-nccl-cu13==2.30.7" "torchvision==0.29.1" "torchaudio==2.11.0"
      "nvidia-cutlass-dsl==4.8.0" "nvidia-cutlass-dsl-libs-base==4.8.0" "nvidia-cutlass-dsl-libs-core==4.8.0"
      "nvidia-cutlass-dsl-libs-cu13==4.8.0" "sgl-flash-mla==1.0.0")
[ -z "${KVC_L23_TRITON:-}" ] || pins+=("triton==$KVC_L23_TRITON")
mapfile -t reqs < <(bundle_requirements "$base_reqs" "torchao email-validator" "${pins[@]}")
src="$dest/l23-src"; x="$(mktemp -d)"; trap 'rm -rf "$x"' EXIT
rm -rf "$src" "$dest"/l23-[0-9]*; mkdir -p "$src/wheels" "$x/items"
bundle_download "$src/wheels" "${reqs[@]}"
n_wheels=$(ls "$src/wheels" | wc -l)
[ "$n_wheels" -eq "${#reqs[@]}" ] || { echo "build_l23_bundle: ${#reqs[@]} requirements, $n_wheels wheels" >&2; exit 1; }

# -- sglang-kernel 0.4.10, trimmed to the sm90 build (bundle_lib.sh)
bundle_kernel_sm90 "sglang-kernel==0.4.10" "$x/items/sgl_kernel_sm90.tgz"

# -- items: wheels over a part's size split into pieces of a part's size, the rest whole
piece=$((part_bytes - meta_bytes))
for w in "$src"/wheels/*.whl; do
  b=$(basename "$w")
  if [ "$(stat -c %s "$w")" -gt "$piece" ]; then split -b "$piece" -d -a 2 "$w" "$x/items/$b.part-"; echo "$b" >> "$x/JOIN"
  else cp "$w" "$x/items/"; fi
done
touch "$x/JOIN"
(cd "$src/wheels" && sha256sum *.whl) > "$x/SHA256SUMS.wheels"
(cd "$x/items" && sha256sum *) > "$x/SHA256SUMS.parts"

# -- parts: first fit, largest first
declare -a fill=()
for f in $(ls -S "$x/items"); do
  s=$(stat -c %s "$x/items/$f"); i=0
  while [ $i -lt ${#fill[@]} ] && [ $((fill[i] + s)) -gt "$piece" ]; do i=$((i + 1)); done
  [ $i -lt ${#fill[@]} ] || fill[i]=0
  fill[i]=$((fill[i] + s)); mkdir -p "$dest/l23-$((i + 1))"; cp "$x/items/$f" "$dest/l23-$((i + 1))/"
  echo "$((i + 1)) $f" >> "$x/PART_OF"
done
n=${#fill[@]}; echo "$n" > "$x/N_PARTS"
cat > "$x/install.sh" <<'INNER'
#!/usr/bin/env bash
# Join, check and install the sglang 0.5.23 bundle copied beside this file (/tmp/l23-parts; written by
# scripts/build_l23_bundle.sh) into $L23_SITE (/tmp/site23), afresh.
set -euo pipefail
parts="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" site="${L23_SITE:-/tmp/site23}"
cd "$parts"
n_parts=$(cat N_PARTS)
missing=$(while read -r i f; do [ -e "$f" ] || echo "$i"; done < PART_OF | sort -un)
[ -z "$missing" ] || { echo "install-l23: part(s) $(echo $missing) of $n_parts not in $parts (not staged, or the" \
  "host went cold: then stage parts 1..$n_parts again)" >&2; exit 1; }
sha256sum -c --quiet SHA256SUMS.parts
while read -r w; do [ -z "$w" ] || cat "$w".part-* > "$w"; done < JOIN
sha256sum -c --quiet SHA256SUMS.wheels
rm -rf "$site"; mkdir -p "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
  $(awk '{print $2}' SHA256SUMS.wheels) > /tmp/l23-pip.log 2>&1 || { cat /tmp/l23-pip.log >&2; exit 1; }
for t in *.tgz; do tar xzf "$t" -C "$site"; done
python3 -m pip list --path "$site" 2>/dev/null | grep -i -E "^(torch|nvidia-nccl-cu13|sglang|sglang-kernel|flashinfer-python|transformers|torchvision) " || true
echo "install-l23: $(awk 'END {print NR}' SHA256SUMS.wheels) wheels and the trimmed sglang-kernel in $site"
INNER
for i in $(seq 1 "$n"); do
  cp "$x/install.sh" "$x/SHA256SUMS.parts" "$x/SHA256SUMS.wheels" "$x/N_PARTS" "$x/PART_OF" "$x/JOIN" "$dest/l23-$i/"
  echo "sglang 0.5.23 bundle, part $i of $n, $(l23_stamp)" > "$dest/l23-$i/MARK"
done
rm -rf "$src"
for i in $(seq 1 "$n"); do
  printf 'l23-%-3s %5.1f MiB  %s\n' "$i" "$(du -sb "$dest/l23-$i" | awk '{print $1 / 1048576}')" \
    "$(awk -v i="$i" '$1 == i {print $2}' "$x/PART_OF" | sed 's/-cp3[0-9]*-.*whl/.whl/; s/-py3-none-.*whl/.whl/' | tr '\n' ' ')"
done
