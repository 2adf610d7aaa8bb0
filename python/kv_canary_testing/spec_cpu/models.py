"""The tiny target + EAGLE and EAGLE3 drafts (``EntryClass``) and, on import, CPU stand-ins for sglang's CUDA-only
EAGLE helpers (see the package docstring). Imported by sglang's model registry in each scheduler process."""

from __future__ import annotations

import torch

from kv_canary_testing.tiny_model.kvc_tiny import KvcTinyForCausalLM
from kv_canary_testing.tiny_model.kvc_tiny_eagle import KvcTinyForCausalLMEagle
from kv_canary_testing.tiny_model.kvc_tiny_eagle3 import KvcTinyForCausalLMEagle3

EntryClass = [KvcTinyForCausalLM, KvcTinyForCausalLMEagle, KvcTinyForCausalLMEagle3]

_FULL_MASK = 0  # eagle_utils.TreeMaskMode.FULL_MASK


def build_tree_topk1(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve_index,
                     retrieve_next_token, retrieve_next_sibling, topk, spec_steps, num_verify_tokens,
                     tree_mask_mode):
    """sgl_kernel.build_tree_kernel_efficient for topk 1: the drafts form a chain.

    FULL_MASK layout: per request a (n, seq_len + n) block, row k attends the whole prefix and
    drafts 0..k; positions seq_len + k; retrieve_index = the flat index; next token k + 1 (-1 last);
    no siblings.
    """
    if topk != 1 or int(tree_mask_mode) != _FULL_MASK:
        raise NotImplementedError("kv_canary_testing.spec_cpu: only topk 1 with the full tree mask")
    n = num_verify_tokens
    off = 0
    for b in range(seq_lens.numel()):
        s = int(seq_lens[b])
        block = tree_mask[off: off + n * (s + n)].view(n, s + n)
        block[:, :s] = True
        block[:, s:] = torch.tril(torch.ones(n, n, dtype=torch.bool, device=block.device))
        off += n * (s + n)
        positions[b * n:(b + 1) * n] = s + torch.arange(n, device=positions.device)
        retrieve_index[b] = b * n + torch.arange(n, device=retrieve_index.device)
        nxt = torch.arange(1, n + 1, device=retrieve_next_token.device)
        nxt[-1] = -1
        retrieve_next_token[b] = nxt
        retrieve_next_sibling[b] = -1


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


def install_cpu_helpers() -> None:
    """Point sglang's EAGLE modules at the stand-ins (idempotent)."""
    from sglang.srt.speculative import eagle_info, eagle_info_v2, eagle_utils
    from sglang.srt.utils.common import next_power_of_2

    def assign_extend_cache_locs_func(req_pool_indices, req_to_token, start_offset, end_offset, batch_size,
                                      draft_token_num, device):
        # the CUDA branch of eagle_info_v2.assign_extend_cache_locs_func: sglang's own Triton kernel
        out = torch.empty((batch_size * draft_token_num,), dtype=torch.int64, device=device)
        eagle_info_v2.assign_extend_cache_locs[(batch_size,)](
            req_pool_indices, req_to_token, start_offset, end_offset, out, req_to_token.shape[1],
            next_power_of_2(batch_size))
        return out

    eagle_utils.sgl_build_tree_kernel_efficient = build_tree_topk1
    for module in (eagle_utils, eagle_info, eagle_info_v2):
        module.verify_tree_greedy_func = verify_tree_greedy
    eagle_info_v2.assign_extend_cache_locs_func = assign_extend_cache_locs_func
    if not getattr(torch.Tensor.record_stream, "_kvc_cpu", False):
        original = torch.Tensor.record_stream

        def record_stream(self, stream):  # overlap_utils.resolve_future / EAGLEWorkerV2.verify on CPU tensors
            return None if self.device.type == "cpu" else original(self, stream)

        record_stream._kvc_cpu = True
        torch.Tensor.record_stream = record_stream


if not torch.cuda.is_available():
    install_cpu_helpers()
