"""The HiCache row's measuring tools (no server): the bench's per-turn profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

from script_loader import _load  # the scripts' loader (test/unit: on the path under pytest)


def test_the_hicache_bench_profiles_each_asked_turn_from_its_first_batch_with_prompts_no_other_run_sent(
        monkeypatch, tmp_path):
    """--profile-turn 0,1: one trace a turn (sglang's /start_profile before the turn's first batch, /stop_profile
    after --profile-batches of them), each from a repetition of its own (after the timed ones'), the turns before
    it sent too (they fill the host tier); bad turn lists refused."""
    hc = _load("bench_hicache_overhead")
    args = hc.parse_args(["--device", "cpu", "--conversations", "4", "--group", "2", "--turns", "3", "--reps", "2",
                          "--profile-batches", "2", "--profile-turn", "1,0"])
    assert args.profile_turns == [0, 1]
    calls = []

    class Session:
        trust_env = True

        def post(self, url, json=None, timeout=None):
            calls.append(url.rsplit("/", 1)[1])
            Path(json["output_dir"], "x.trace.json.gz").write_text("") if json else None
            return type("R", (), {"raise_for_status": lambda self: None})()
    monkeypatch.setattr(hc.requests, "Session", Session)
    monkeypatch.setattr(hc, "run_batch", lambda url, batch, n: calls.append(len(batch[0])))
    monkeypatch.setattr(hc, "summarize_trace", lambda path: {"trace": path.name})
    for turn in args.profile_turns:
        calls.clear()
        assert hc.profile_batches("http://x", args, {"token_range": (1, 9)}, turn, tmp_path / str(turn)) == {
            "trace": "x.trace.json.gz"}
        turn_len = [len(b[0]) for b in hc.repetition(args, (1, 9), args.reps + turn)]
        assert calls == turn_len[:2 * turn] + ["start_profile"] + turn_len[2 * turn:2 * turn + 2] + ["stop_profile"]
    assert hc.repetition(args, (1, 9), 2) != hc.repetition(args, (1, 9), 1)  # not a timed repetition's prompts
    for bad in ("3", "0,x", "", "-1"):
        with pytest.raises(SystemExit):
            hc.parse_args(["--profile-batches", "1", "--profile-turn", bad])
    with pytest.raises(SystemExit):  # turn 2 has 6 batches from its first on
        hc.parse_args(["--profile-batches", "7", "--profile-turn", "0,2"])
