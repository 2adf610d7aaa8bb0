"""The server-args allow-list classifies every sglang 0.5.12 ``ServerArgs`` field, and accepts the defaults."""

from __future__ import annotations

import dataclasses

import pytest

from kv_canary.adapter.server_args import CHECKED_ELSEWHERE, NEUTRAL, RULES, check_supported, flag_name
from kv_canary.config import CanaryConfigError

server_args_mod = pytest.importorskip("sglang.srt.server_args")


def test_every_server_args_field_is_classified_exactly_once():
    fields = {f.name for f in dataclasses.fields(server_args_mod.ServerArgs)}
    rules, elsewhere = set(RULES), set(CHECKED_ELSEWHERE)
    assert not (rules & NEUTRAL) and not (rules & elsewhere) and not (elsewhere & NEUTRAL)
    assert fields - (rules | elsewhere | NEUTRAL) == set(), "unreviewed ServerArgs fields"
    assert (rules | elsewhere | NEUTRAL) - fields == set(), "classified names that are not ServerArgs fields"


def test_sglang_defaults_are_supported():
    class Defaults:
        def __getattr__(self, name):
            return getattr(server_args_mod.ServerArgs, name, None)

    check_supported(Defaults(), "log")


@pytest.mark.parametrize("field", sorted(RULES))
def test_a_value_outside_the_allow_list_is_refused_naming_flag_and_value(field):
    class Odd:
        """Every field at its default, except ``field`` at a value no rule lists."""

        def __getattr__(self, name):
            return "NEW_VALUE_1" if name == field else getattr(server_args_mod.ServerArgs, name, None)

    with pytest.raises(CanaryConfigError, match=f"cannot verify {flag_name(field)} NEW_VALUE_1.*--kv-canary none"):
        check_supported(Odd(), "log")


def test_raw_flags_not_given_are_left_to_sglang():
    class Raw:
        def __getattr__(self, name):
            return None  # argparse: nothing given

    check_supported(Raw(), "log", given_only=True)
