"""The sglang 0.5.17 line (``adapter/lines/v0_5_17``): a diff of the 0.5.23 line, with CUDA graphs verified.

The table and policy diffs run anywhere; the checks against sglang's own code need sglang 0.5.17 installed
(``KVC_SGLANG=0.5.17 source scripts/setup_env.sh``) and skip elsewhere.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from types import SimpleNamespace

import pytest

from kv_canary.adapter import hooks
from kv_canary.adapter.lines import choose_line, v0_5_12, v0_5_17, v0_5_23
from kv_canary.adapter.policy_0_5_17 import _NOT_YET, _ONLY_0_5_17_NEUTRAL, _ONLY_0_5_17_RULES, POLICY_0_5_17
from kv_canary.adapter.policy_0_5_23 import POLICY_0_5_23, PREFILL_GRAPHS_OFF_RULES

DECODE_CAPTURE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture_one_shape"
POST_INIT = "sglang.srt.server_args.ServerArgs.__post_init__"
RESOLVE_ONCE = "sglang.srt.server_args.ServerArgs.resolve_once"


def installed_sglang():
    try:
        return importlib.import_module("sglang.version").__version__
    except ImportError:
        return None


on_0_5_17 = pytest.mark.skipif(installed_sglang() != "0.5.17", reason="needs sglang 0.5.17 installed")


def test_the_line_is_chosen_for_0_5_17_and_takes_the_in_tree_canarys_place():
    line = choose_line("0.5.17", has_in_tree_canary=True, environ={}).line
    assert line is v0_5_17.LINE and line.in_tree_canary and line.flags_declared_by_sglang
    assert line.policy is POLICY_0_5_17
    assert choose_line("0.5.17", has_in_tree_canary=True, environ={"SGLANG_KV_CANARY_IMPL": "in-tree"}).line is None


def test_the_hook_table_is_0_5_23s_but_resolve_once_plus_post_init_and_the_decode_capture():
    ours, theirs = dict(v0_5_17.HOOKS), dict(v0_5_23.HOOKS)
    assert set(theirs) - set(ours) == {RESOLVE_ONCE}
    radix = {t for t in v0_5_12.HOOKS if t.startswith("sglang.srt.mem_cache.radix_cache.RadixCache.")}
    assert len(radix) == 3 and all(ours[t] == v0_5_12.HOOKS[t] for t in radix)  # 0.5.12's RadixCache tree hooks
    assert set(ours) - set(theirs) == {POST_INIT} | radix
    assert all(ours[t] == theirs[t] for t in set(ours) & set(theirs))
    assert ours[POST_INIT] == theirs[RESOLVE_ONCE]
    assert ours[DECODE_CAPTURE] == ("hooks.around_capture_one_batch_size", "around")  # 0.5.12's capture hook, 0.5.23's


def test_cuda_graphs_are_not_refused_but_post_capture_kv_sizing_and_unported_features_are(monkeypatch):
    monkeypatch.delenv(v0_5_17.POST_CAPTURE_KV_SIZING_ENV, raising=False)
    ok = SimpleNamespace(device="cuda", disable_cuda_graph=False, kv_canary="raise", tp_size=1,
                         disaggregation_mode="null", speculative_algorithm=None)
    assert v0_5_17.unported(ok) == ""
    assert v0_5_23.unported(ok) == ""  # 0.5.23's graphs: verified on the GPU host (docs/results)
    for field, value, named in [("kv_canary", "contain", "contain"), ("speculative_algorithm", "EAGLE", "speculative"),
                                ("tp_size", 2, "--tp-size"), ("disaggregation_mode", "prefill", "--disaggregation-mode")]:
        assert named in v0_5_17.unported(SimpleNamespace(**{**vars(ok), field: value}))
    monkeypatch.setenv(v0_5_17.POST_CAPTURE_KV_SIZING_ENV, "1")
    assert v0_5_17.unported(ok).startswith("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1")


def test_the_policy_is_0_5_23s_on_0_5_17s_fields():
    """Exhaustive against the installed 0.5.17 in test_server_args_policy; here: the diff is consistent."""
    fields_23 = set().union(*POLICY_0_5_23.classified())
    assert _NOT_YET <= fields_23, "names 0.5.23 does not have"
    rules, elsewhere, neutral = POLICY_0_5_17.classified()
    assert rules | elsewhere | neutral == (fields_23 - _NOT_YET) | set(_ONLY_0_5_17_RULES) | _ONLY_0_5_17_NEUTRAL
    assert not (rules & neutral) and not (rules & elsewhere) and not (elsewhere & neutral)
    for field, rule in POLICY_0_5_23.rules.items():  # every 0.5.23 rule 0.5.17 has is the same rule, but the graphs'
        assert field in _NOT_YET or field in PREFILL_GRAPHS_OFF_RULES or POLICY_0_5_17.rules[field] is rule
    assert all(POLICY_0_5_17.rules[field] is rule for field, rule in PREFILL_GRAPHS_OFF_RULES.items())


class _Manager:
    def __init__(self):
        self.entered = []

    @contextlib.contextmanager
    def capturing(self):
        self.entered.append("capturing")
        yield

    def with_active_single_forward_manager(self, index):
        self.entered.append(f"active{index}")
        return contextlib.nullcontext()


def test_decode_capture_runs_inside_capturing_with_manager_0_active():
    manager = _Manager()
    runner = SimpleNamespace(model_runner=SimpleNamespace(canary_manager=v0_5_23.InTreeSlot(manager)))
    seen = []
    hooks.around_capture_one_batch_size(lambda gr, size, fwd: seen.append((size, sorted(manager.entered))), runner, 8,
                                        None)
    assert seen == [(8, ["active0", "capturing"])]
    draft = SimpleNamespace(model_runner=SimpleNamespace(canary_manager=None, is_draft_worker=True))
    hooks.around_capture_one_batch_size(lambda gr, *a: seen.append(a), draft, 4)
    assert seen[-1] == (4,)


@on_0_5_17
def test_every_hook_target_exists_in_sglang_0_5_17():
    missing = []
    for target in v0_5_17.LINE.all_hooks():
        module, _, attr = target.rpartition(".")
        try:
            getattr(pkgutil.resolve_name(module), attr)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{target}: {exc}")
    assert missing == []


@on_0_5_17
def test_sglang_0_5_17_calls_the_in_tree_canary_where_the_line_expects():
    """The call sites the line relies on: the binding it replaces, and no post-capture workspace query."""
    import inspect

    from sglang.srt.model_executor import model_runner
    from sglang.srt.model_executor.runner import decode_cuda_graph_runner

    assert model_runner.install_canary.__module__ in ("sglang.srt.kv_canary.api", "kv_canary.adapter.lines.v0_5_23")
    src = inspect.getsource(model_runner.ModelRunner._init_post_memory_pool_components)
    assert "install_canary(" in src
    assert "with_active_single_forward_manager(0)" in inspect.getsource(
        decode_cuda_graph_runner.DecodeCudaGraphRunner.capture_one_shape)
    from sglang.srt.model_executor.model_runner_components import kv_pool_runtime

    assert "per_forward_workspace_bytes" not in inspect.getsource(kv_pool_runtime)
    assert "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING" in inspect.getsource(
        importlib.import_module("sglang.srt.server_args").ServerArgs.post_capture_kv_sizing_planned)


@on_0_5_17
def test_a_resolved_0_5_17_cuda_graph_config_is_read():
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig

    def resolved(prefill):
        return SimpleNamespace(disable_prefill_cuda_graph=False, _resolved_overrides=[("h", {})],
                               cuda_graph_config=CudaGraphConfig(decode=PhaseConfig(backend="full"),
                                                                 prefill=PhaseConfig(backend=prefill)))

    rule = POLICY_0_5_17.rules["disable_prefill_cuda_graph"]
    assert rule.allowed(False, resolved("disabled"))
    assert not rule.allowed(False, resolved("breakable"))
    assert POLICY_0_5_17.rules["cuda_graph_config"].allowed(resolved("disabled").cuda_graph_config, None)
    assert not POLICY_0_5_17.rules["cuda_graph_config"].allowed(resolved("tc_piecewise").cuda_graph_config, None)


def test_an_mha_pool_installs_without_reading_0_5_23s_mamba_view(monkeypatch):
    """0.5.17 reuses 0.5.23's install: the hybrid-linear strategy (read through a view only 0.5.23 has) is asked
    for a HybridLinearKVPool only (on the H100 every 0.5.17 server failed at install while it was asked always)."""
    from kv_canary.config import CanaryConfigError

    def only_on_0_5_23(server_args):
        raise ImportError("No module named 'sglang.srt.arg_groups.model_override_base'")

    monkeypatch.setattr(v0_5_23, "mamba_strategy", only_on_0_5_23)
    for pool in ("MHATokenToKVPool", "MLATokenToKVPool"):
        v0_5_23.refuse_unverified_pool(SimpleNamespace(), pool, "raise", v0_5_17.LINE)
    with pytest.raises(CanaryConfigError, match="HybridLinearKVPool is not verified on sglang 0.5.17"):
        v0_5_23.refuse_unverified_pool(SimpleNamespace(), "HybridLinearKVPool", "raise", v0_5_17.LINE)
    monkeypatch.setattr(v0_5_23, "mamba_strategy", lambda server_args: "extra_buffer")
    with pytest.raises(CanaryConfigError, match="--mamba-radix-cache-strategy extra_buffer"):
        v0_5_23.refuse_unverified_pool(SimpleNamespace(), "HybridLinearKVPool", "raise", v0_5_23.LINE)
