"""The sglang 0.5.23 line's tensor-parallel and pool readers (``adapter/lines/v0_5_23``).

The table checks run anywhere; the readers of sglang's own objects need sglang 0.5.23 installed and skip
elsewhere.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from kv_canary.adapter.lines import v0_5_12, v0_5_17, v0_5_23


def installed_sglang():
    try:
        return importlib.import_module("sglang.version").__version__
    except ImportError:
        return None


on_0_5_23 = pytest.mark.skipif(installed_sglang() != "0.5.23", reason="needs sglang 0.5.23 installed")


def test_tensor_parallel_is_no_longer_refused_on_0_5_23_but_still_on_0_5_17():
    args = SimpleNamespace(device="cpu", disable_cuda_graph=True, kv_canary="raise", tp_size=2,
                           disaggregation_mode="null", speculative_algorithm=None)
    assert v0_5_23.unported(args) == ""
    assert "--tp-size" in v0_5_17.unported(args)


def test_each_line_names_the_pools_it_verifies():
    assert v0_5_12.LINE.verified_pools is None  # every class adapter/pools registers
    assert set(v0_5_23.LINE.verified_pools) >= {"MHATokenToKVPool", "MLATokenToKVPool"}
    assert v0_5_17.LINE.verified_pools == ("MHATokenToKVPool", "MLATokenToKVPool")  # 0.5.23's ports not run there


def test_the_0_5_12_tp_rank_reader_reads_the_model_runner():
    assert v0_5_12.LINE.tp_rank(SimpleNamespace(tp_rank=1)) == 1
    assert v0_5_12.LINE.tp_rank(SimpleNamespace()) == 0


@on_0_5_23
def test_the_0_5_23_tp_rank_reader_reads_sglangs_parallel_context(monkeypatch):
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(rc, "get_parallel", lambda: SimpleNamespace(tp_rank=1))
    assert v0_5_23.LINE.tp_rank(SimpleNamespace(tp_rank=0)) == 1  # 0.5.23's ModelRunner has no tp_rank of its own
