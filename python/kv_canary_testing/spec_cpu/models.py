"""The tiny target + EAGLE and EAGLE3 drafts (``EntryClass``) and, on import, CPU stand-ins for sglang's CUDA-only
EAGLE helpers (see the package docstring). Imported by sglang's model registry in each scheduler process."""

from __future__ import annotations

import torch

from kv_canary_testing.tiny_model.kvc_tiny import KvcTinyForCausalLM
from kv_canary_testing.tiny_model.kvc_tiny_eagle import KvcTinyForCausalLMEagle
from kv_canary_testing.tiny_model.kvc_tiny_eagle3 import KvcTinyForCausalLMEagle3
from kv_canary_testing.tiny_model.kvc_tiny_swa import LagunaForCausalLM

EntryClass = [KvcTinyForCausalLM, KvcTinyForCausalLMEagle, KvcTinyForCausalLMEagle3, LagunaForCausalLM]

_FULL_MASK = 0  # eagle_utils.TreeMaskMode.FULL_MASK


def build_tree(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve_index,
               retrieve_next_token, retrieve_next_sibling, topk, spec_steps, num_verify_tokens, tree_mask_mode):
    """sgl_kernel.build_tree_kernel_efficient (``build_tree_efficient``), FULL_MASK mode, any topk.

    Node 0 of request b is the bonus token (the root), node k >= 1 the draft ``top_scores_index[b, k - 1]``
    (a flat index into ``organize_draft_results``' score list). Its parent: ``s // topk`` indexes
    ``parent_list[b]`` (0: the root; else the parent's flat index, found among the selected nodes).
    FULL_MASK layout: per request a (n, seq_len + n) block of the flat mask, row k attends the whole prefix,
    the root, its ancestors and itself; positions seq_len + depth; retrieve_index = the flat index
    b * n + k; retrieve_next_token[b, parent] = its first child (the lowest node index), the other children
    chained through retrieve_next_sibling in increasing order (the kernel links them from the last node down).
    """
    if int(tree_mask_mode) != _FULL_MASK:
        raise NotImplementedError("kv_canary_testing.spec_cpu: only the full tree mask")
    n = num_verify_tokens
    off = 0
    selected = top_scores_index.to(torch.int64).tolist()
    parents = parent_list.to(torch.int64).tolist() if parent_list.numel() else [[] for _ in selected]
    for b in range(seq_lens.numel()):
        s = int(seq_lens[b])
        block = tree_mask[off: off + n * (s + n)].view(n, s + n)
        off += n * (s + n)
        block[:, :s + 1] = True
        block[:, s + 1:] = False
        sel = selected[b]

        def parent_node(k):  # node index (0: root) of node k's parent
            tb = sel[k - 1] // topk
            if tb == 0:
                return 0
            want = parents[b][tb]
            if want not in sel:
                raise RuntimeError(f"spec_cpu.build_tree: the parent {want} of draft {sel[k - 1]} was not selected")
            return sel.index(want) + 1

        par = [0] + [parent_node(k) for k in range(1, n)]
        depth = [0] * n
        for k in range(1, n):
            a = k
            while a != 0:
                block[k, s + a] = True
                depth[k] += 1
                a = par[a]
        positions[b * n:(b + 1) * n] = torch.tensor([s + d for d in depth], dtype=positions.dtype)
        retrieve_index[b] = b * n + torch.arange(n, device=retrieve_index.device)
        retrieve_next_token[b] = -1
        retrieve_next_sibling[b] = -1
        for k in range(n - 1, 0, -1):  # the kernel's order: the lowest child ends up first
            p = par[k]
            first = int(retrieve_next_token[b, p])
            retrieve_next_token[b, p] = k
            if first != -1:
                retrieve_next_sibling[b, k] = first


def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
                       retrieve_next_sibling, target_predict, topk=-1):
    """sgl_kernel.verify_tree_greedy: walk the tree from the root, accept a child whose draft equals the
    target's prediction at the last accepted node; predicts[node] = the target's prediction there."""
    bs = candidates.shape[0]
    tp = target_predict.flatten()
    for b in range(bs):
        last = int(retrieve_index[b, 0])
        accept_index[b, 0] = last
        num, cur = 0, 0
        for _ in range(1, accept_index.shape[1]):
            cur = int(retrieve_next_token[b, cur])
            while cur != -1:
                if int(candidates[b, cur]) == int(tp[last]):
                    predicts[last] = tp[last]
                    num += 1
                    last = int(retrieve_index[b, cur])
                    accept_index[b, num] = last
                    break
                cur = int(retrieve_next_sibling[b, cur])
            if cur == -1:
                break
        accept_token_num[b] = num
        predicts[last] = tp[last]
    return predicts, accept_index, accept_token_num


def tree_sampling_target_only(predicts, accept_index, accept_token_num, candidates, retrive_index,
                              retrive_next_token, retrive_next_sibling, uniform_samples,
                              uniform_samples_for_final_sampling, target_probs, draft_probs, threshold_single=1.0,
                              threshold_acc=1.0, deterministic=True):
    """sgl_kernel's tree_speculative_sampling_target_only (temperature > 0; CUDA only in sglang 0.5.23): walk the
    tree from the root; a child is accepted when its coin is at most the target's accumulated probability of the
    siblings tried (``/ threshold_acc``) or its own probability reaches ``threshold_single``; a rejected draft's
    target probability goes to ``draft_probs``; the token after the last accepted node is sampled from
    relu(target - draft) there (the target alone after every draft was accepted)."""
    bs, n = candidates.shape
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        num, cur, offset, acc = 0, 0, 0, 0.0
        coin = float(uniform_samples[b, 0])
        for _ in range(1, n):
            cur = int(retrive_next_token[b, cur])
            while cur != -1:
                tok = int(candidates[b, cur])
                p = float(target_probs[b, offset, tok])
                acc += p
                if coin <= acc / threshold_acc or p >= threshold_single:
                    acc, offset, coin = 0.0, cur, float(uniform_samples[b, cur])
                    predicts[last] = tok
                    num += 1
                    last = int(retrive_index[b, cur])
                    accept_index[b, num] = last
                    break
                draft_probs[b, offset, tok] = target_probs[b, offset, tok]
                cur = int(retrive_next_sibling[b, cur])
            if cur == -1:
                break
        accept_token_num[b] = num
        q = target_probs[b, offset].to(torch.float64)
        if num != n - 1:
            q = torch.clamp(q - draft_probs[b, offset].to(torch.float64), min=0)
        cdf = torch.cumsum(q, 0)
        u = float(uniform_samples_for_final_sampling[b]) * float(cdf[-1])
        predicts[last] = min(int(torch.searchsorted(cdf, torch.tensor(u, dtype=cdf.dtype), right=True)), q.numel() - 1)


def install_cpu_helpers() -> None:
    """Point sglang's EAGLE modules at the stand-ins (idempotent)."""
    try:
        from sglang.kernels.ops.speculative import spec_tree  # noqa: F401  0.5.23's layout of the EAGLE helpers
    except ImportError:
        pass
    else:
        _install_cpu_helpers_kernels_ops()
        return
    from sglang.srt.speculative import eagle_info, eagle_info_v2, eagle_utils, spec_utils
    from sglang.srt.utils.common import next_power_of_2

    def assign_extend_cache_locs_func(req_pool_indices, req_to_token, start_offset, end_offset, batch_size,
                                      draft_token_num, device):
        # the CUDA branch of eagle_info_v2.assign_extend_cache_locs_func: sglang's own Triton kernel
        out = torch.empty((batch_size * draft_token_num,), dtype=torch.int64, device=device)
        eagle_info_v2.assign_extend_cache_locs[(batch_size,)](
            req_pool_indices, req_to_token, start_offset, end_offset, out, req_to_token.shape[1],
            next_power_of_2(batch_size))
        return out

    eagle_utils.sgl_build_tree_kernel_efficient = build_tree
    for module in (eagle_utils, eagle_info, eagle_info_v2):
        module.verify_tree_greedy_func = verify_tree_greedy
    eagle_info_v2.assign_extend_cache_locs_func = assign_extend_cache_locs_func
    # spec v1, topk > 1: the draft steps after the first run sglang's @torch.compile'd top-k selection; on CPU
    # that needs inductor's C++ toolchain and minutes per shape, so run the same function uncompiled
    later = spec_utils._select_top_k_tokens_later
    spec_utils._select_top_k_tokens_later = getattr(later, "_torchdynamo_orig_callable", later)
    _cpu_record_stream()


def _install_cpu_helpers_kernels_ops() -> None:
    """sglang with its EAGLE helpers under ``sglang.kernels.ops.speculative`` (0.5.23): those modules carry
    Triton implementations for Intel GPUs (their ``_is_xpu`` branches: the tree build, the greedy tree walk, the
    verify's cache locations), which run on CPU under the Triton interpreter; the stand-in points those modules at
    their own Triton branches, and makes ``record_stream`` a no-op on CPU tensors."""
    from sglang.kernels.ops.speculative import cache_locs, spec_tree
    from sglang.srt.speculative import eagle_utils

    cache_locs._is_xpu = True
    spec_tree._is_xpu = True
    if eagle_utils.tree_speculative_sampling_target_only is None:  # sampling verify (temperature > 0): CUDA only
        eagle_utils.tree_speculative_sampling_target_only = tree_sampling_target_only
    _cpu_record_stream()


def _cpu_record_stream() -> None:
    if not getattr(torch.Tensor.record_stream, "_kvc_cpu", False):
        original = torch.Tensor.record_stream

        def record_stream(self, stream):  # overlap_utils.resolve_future / EAGLEWorkerV2.verify on CPU tensors
            return None if self.device.type == "cpu" else original(self, stream)

        record_stream._kvc_cpu = True
        torch.Tensor.record_stream = record_stream


if not torch.cuda.is_available():
    install_cpu_helpers()
