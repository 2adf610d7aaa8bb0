"""EAGLE on CPU for the e2e tests: an external model package (``SGLANG_EXTERNAL_MODEL_PACKAGE=
kv_canary_testing.spec_cpu``) with the tiny target and EAGLE draft models, whose import also
gives sglang 0.5.12's CUDA-only EAGLE helpers a CPU implementation (``models.install_cpu_helpers``).

Stock sglang 0.5.12 cannot serve EAGLE on CPU (docs/history/speculative.md lists the blockers by
file:line). The stand-ins replace only sglang's GPU kernels (any topk: the draft tree's mask, positions
and links; the greedy tree walk), each with what the CUDA op computes, and run sglang's compiled top-k
selection uncompiled; sglang's scheduler, EAGLE worker, KV pools, allocator and
attention (Triton, under the interpreter) run unchanged, and so does the canary. Outputs equal
non-speculative greedy decoding of the same target (checked when this was written).
"""
