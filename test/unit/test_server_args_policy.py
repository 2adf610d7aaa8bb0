"""The installed sglang line's server-args allow-list classifies every ``ServerArgs`` field, and accepts the defaults.

The policy is picked by sglang's version (``POLICIES``); the line adapter must carry the same
one (``test_the_line_adapter_carries_this_policy``, once that line's adapter is importable).
"""

from __future__ import annotations

import dataclasses

import pytest

from kv_canary.adapter.policy_0_5_15 import POLICY_0_5_13, POLICY_0_5_14, POLICY_0_5_15
from kv_canary.adapter.policy_0_5_17 import POLICY_0_5_17
from kv_canary.adapter.policy_0_5_18 import POLICY_0_5_18
from kv_canary.adapter.policy_0_5_19 import POLICY_0_5_19
from kv_canary.adapter.policy_0_5_20 import POLICY_0_5_20
from kv_canary.adapter.policy_0_5_21 import POLICY_0_5_21
from kv_canary.adapter.policy_0_5_23 import POLICY_0_5_23
from kv_canary.adapter.server_args import POLICY_0_5_12, check_supported, flag_name
from kv_canary.config import CanaryConfigError

server_args_mod = pytest.importorskip("sglang.srt.server_args")
SGLANG_VERSION = pytest.importorskip("sglang.version").__version__

POLICIES = {"0.5.12": POLICY_0_5_12, "0.5.13": POLICY_0_5_13, "0.5.13.post1": POLICY_0_5_13, "0.5.14": POLICY_0_5_14,
            "0.5.15": POLICY_0_5_15, "0.5.15.post1": POLICY_0_5_15, "0.5.17": POLICY_0_5_17, "0.5.18": POLICY_0_5_18,
            "0.5.19": POLICY_0_5_19, "0.5.20": POLICY_0_5_20, "0.5.21": POLICY_0_5_21, "0.5.23": POLICY_0_5_23}
if SGLANG_VERSION not in POLICIES:
    pytest.skip(f"no server-args policy for sglang {SGLANG_VERSION}", allow_module_level=True)
POLICY = POLICIES[SGLANG_VERSION]
on_0_5_23 = pytest.mark.skipif(POLICY is not POLICY_0_5_23, reason="sglang 0.5.23's rules")
# per-phase CUDA graph config with prefill graphs refused (0.5.23 verifies them)
PHASE_GRAPH_LINES = (POLICY_0_5_14, POLICY_0_5_15, POLICY_0_5_17, POLICY_0_5_18, POLICY_0_5_19, POLICY_0_5_20)
on_phase_graph_lines = pytest.mark.skipif(POLICY not in PHASE_GRAPH_LINES, reason="sglang 0.5.17's rules")


def server_args_defaults() -> dict:
    """Field -> default of the installed ``ServerArgs`` (0.5.12: a dataclass; 0.5.23: a msgspec Struct)."""
    cls = server_args_mod.ServerArgs
    if dataclasses.is_dataclass(cls):
        return {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING
                         else None if f.default is dataclasses.MISSING else f.default)
                for f in dataclasses.fields(cls)}
    import msgspec

    return {f.name: (f.default_factory() if f.default_factory is not msgspec.NODEFAULT
                     else None if f.default is msgspec.NODEFAULT else f.default)
            for f in msgspec.structs.fields(cls)}


DEFAULTS = server_args_defaults()


class Settings:
    """Every ``ServerArgs`` field at its default (None for a name that is not a field), but ``overrides``."""

    def __init__(self, **overrides):
        self._values = {**DEFAULTS, **overrides}

    def __getattr__(self, name):
        return self._values.get(name)


def supported_defaults(**overrides) -> Settings:
    # 0.5.17 captures breakable prefill CUDA graphs by default on CUDA, which the canary refuses there (0.5.23's
    # adapter verifies them): the defaults are supported with CUDA graphs off
    return Settings(**{"disable_cuda_graph": True, **overrides} if POLICY in PHASE_GRAPH_LINES else overrides)


def test_every_server_args_field_is_classified_exactly_once():
    rules, elsewhere, neutral = POLICY.classified()
    assert not (rules & neutral) and not (rules & elsewhere) and not (elsewhere & neutral)
    assert set(DEFAULTS) - (rules | elsewhere | neutral) == set(), "unreviewed ServerArgs fields"
    assert (rules | elsewhere | neutral) - set(DEFAULTS) == set(), "classified names that are not ServerArgs fields"


def test_the_line_adapter_carries_this_policy():
    from kv_canary.adapter.lines import load_line, release_modules

    try:
        line = load_line(release_modules()[SGLANG_VERSION])
    except ImportError as exc:
        pytest.skip(f"the sglang {SGLANG_VERSION} line adapter is not importable here: {exc}")
    assert line.policy_for(SGLANG_VERSION) is POLICY


def test_sglang_defaults_are_supported():
    check_supported(supported_defaults(), "log", policy=POLICY)


@pytest.mark.parametrize("field", sorted(POLICY.rules))
def test_a_value_outside_the_allow_list_is_refused_naming_flag_and_value(field):
    odd = supported_defaults(**{field: "NEW_VALUE_1"})  # no rule lists it
    with pytest.raises(CanaryConfigError, match=f"cannot verify {flag_name(field)} NEW_VALUE_1.*--kv-canary none"):
        check_supported(odd, "log", policy=POLICY)


def test_raw_flags_not_given_are_left_to_sglang():
    class Raw:
        def __getattr__(self, name):
            return None  # argparse: nothing given

    check_supported(Raw(), "log", given_only=True, policy=POLICY)


@on_phase_graph_lines
@pytest.mark.parametrize("flags, refused", [
    # sglang's precedence: the per-phase flag beats --disable-cuda-graph, the JSON beats both
    (dict(disable_cuda_graph=True, cuda_graph_backend_prefill="breakable"), "--cuda-graph-backend-prefill breakable"),
    (dict(disable_cuda_graph=True, cuda_graph_config={"prefill": {"backend": "full"}}), "--cuda-graph-config"),
    (dict(disable_prefill_cuda_graph=True, cuda_graph_config={"decode": {"backend": "breakable"}}),
     "--cuda-graph-config"),
    (dict(device="cuda", disable_cuda_graph=False), "--disable-prefill-cuda-graph False"),
])
def test_prefill_cuda_graphs_are_refused(monkeypatch, flags, refused):
    from sglang.srt.model_executor import cuda_graph_config

    monkeypatch.setattr(cuda_graph_config, "default_prefill_backend", lambda: "breakable",  # CUDA default
                        raising=False)  # 0.5.14 has none (tc_piecewise, its config default)
    with pytest.raises(CanaryConfigError, match=f"cannot verify {refused}"):
        check_supported(Settings(**flags), "log", policy=POLICY)


@on_phase_graph_lines
@pytest.mark.parametrize("flags", [dict(disable_cuda_graph=True), dict(disable_prefill_cuda_graph=True),
                                   dict(cuda_graph_backend_prefill="disabled"), dict(device="cpu"),
                                   dict(cuda_graph_config={"prefill": {"backend": "disabled"}})])
def test_prefill_cuda_graphs_off_are_supported(monkeypatch, flags):
    from sglang.srt.model_executor import cuda_graph_config

    monkeypatch.setattr(cuda_graph_config, "default_prefill_backend", lambda: "breakable", raising=False)
    check_supported(Settings(**flags), "log", policy=POLICY)
    check_supported(Settings(**flags), "log", given_only=True, policy=POLICY)


@on_0_5_23
@pytest.mark.parametrize("flags", [
    dict(device="cuda", disable_cuda_graph=False),  # 0.5.23's defaults: decode full, prefill breakable
    dict(cuda_graph_backend_prefill="breakable"), dict(cuda_graph_backend_decode="full"),
    dict(cuda_graph_backend_prefill="disabled"), dict(cuda_graph_backend_decode="disabled"),
    dict(cuda_graph_config={"prefill": {"backend": "breakable"}, "decode": {"backend": "full"}}),
    dict(disable_prefill_cuda_graph=True), dict(disable_cuda_graph=True),
])
def test_the_cuda_graph_backends_verified_on_0_5_23_are_supported(flags):
    check_supported(Settings(**flags), "log", policy=POLICY)
    check_supported(Settings(**flags), "log", given_only=True, policy=POLICY)


@on_0_5_23
@pytest.mark.parametrize("flags, refused", [
    # backends sglang allows that were not run with the canary (full prefill, breakable decode), and one it lacks
    (dict(cuda_graph_backend_prefill="full"), "--cuda-graph-backend-prefill full.*full prefill graphs were not run"),
    (dict(cuda_graph_backend_decode="breakable"), "--cuda-graph-backend-decode breakable.*breakable decode graphs"),
    (dict(cuda_graph_config={"prefill": {"backend": "full"}}), "--cuda-graph-config"),
    (dict(cuda_graph_config={"decode": {"backend": "breakable"}}), "--cuda-graph-config"),
    (dict(cuda_graph_backend_prefill="tc_piecewise"), "--cuda-graph-backend-prefill tc_piecewise"),
])
def test_a_cuda_graph_backend_not_run_with_the_canary_on_0_5_23_is_refused(flags, refused):
    with pytest.raises(CanaryConfigError, match=f"cannot verify {refused}"):
        check_supported(Settings(**flags), "log", policy=POLICY)
