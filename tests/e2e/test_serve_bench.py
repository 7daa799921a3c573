"""bench/serve.py's arithmetic with known inputs: DistServe's goodput (TTFT and per-request TPOT SLOs), the sweep's
highest rate meeting the attainment, percentiles, and the comparison table from result files."""
import json

import pytest

from bench.serve import SLO, Result, compare, goodput, max_rate_meeting, percentile, summarize


def req(ttft: float, tokens: int, gaps: list[float] | None = None, ok: bool = True) -> Result:
    """A completed request with TTFT `ttft` and `tokens` output tokens, the later ones `gaps` apart."""
    gaps = gaps if gaps is not None else []
    assert len(gaps) == max(tokens - 1, 0)
    return Result(ok=ok, ttft=ttft, latency=ttft + sum(gaps), itl=list(gaps), prompt_tokens=8, output_tokens=tokens)


# SLO and times are binary fractions, so the equality cases are exact.
SLO_ = SLO(ttft_s=0.25, tpot_s=0.03125)
RESULTS = [
    req(0.125, 5, [0.015625] * 4),                 # good
    req(0.375, 5, [0.015625] * 4),                 # TTFT over
    req(0.125, 5, [0.0625] * 4),                   # TPOT over
    req(0.25, 3, [0.03125] * 2),                   # both exactly at the SLO: good
    req(0.0625, 0, ok=False),                      # failed: never good, counts against attainment
    req(0.125, 1),                                 # one token: no TPOT, TTFT decides: good
    req(0.125, 5, [0.0078125] * 3 + [0.0625]),     # one gap over 31.25 ms, mean 21.5 ms: good (per-request TPOT)
]


def test_goodput_counts_requests_meeting_ttft_and_tpot():
    assert [SLO_.met(r) for r in RESULTS] == [True, False, False, True, False, True, True]
    assert goodput(RESULTS, duration=2.0, slo=SLO_) == {"good": 4, "goodput_per_s": 2.0, "attainment": 4 / 7}
    assert goodput([], duration=1.0, slo=SLO_) == {"good": 0, "goodput_per_s": 0.0, "attainment": 0.0}
    with pytest.raises(ValueError, match="must be > 0"):
        SLO(0.2, 0.0)


def test_summary_percentiles_and_slo_block():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([float(x) for x in range(1, 101)], 99) == pytest.approx(99.01)
    s = summarize(RESULTS, 2.0, None, SLO_)
    assert (s["completed"], s["failed"]) == (6, 1)
    assert s["slo"] == {"ttft_ms": 250.0, "tpot_ms": 31.25, "good": 4, "goodput_per_s": 2.0, "attainment": 4 / 7}
    assert s["ttft_ms"]["p50"] == 125.0  # TTFTs of the 6 completed: 62.5 excluded (failed)
    # TPOTs (ms) 15.625, 15.625, 62.5, 31.25, 21.484375 (the one-token request has none): median 21.484375.
    assert s["tpot_ms"]["p50"] == pytest.approx(21.484375)


def run(rate: float, attainment: float) -> dict:
    return {"request_rate": rate, "results": {"slo": {"attainment": attainment}}}


def test_sweep_goodput_is_the_highest_rate_up_to_which_all_meet_the_attainment():
    assert max_rate_meeting([run(4, 1.0), run(8, 0.95), run(16, 0.5), run(32, 0.92)], 0.9) == 8
    assert max_rate_meeting([run(16, 0.95), run(4, 1.0), run(8, 0.9)], 0.9) == 16  # order as swept does not matter
    assert max_rate_meeting([run(4, 0.89), run(8, 1.0)], 0.9) is None


def test_compare_prints_one_row_per_server_and_rate(tmp_path):
    summary = summarize(RESULTS, 2.0, None, SLO_)
    args = {"slo_attainment": 0.5, "slo_ttft_ms": 250.0, "slo_itl_ms": 31.25, "idle_input_len": 512}
    idle = {"probes": 3, "failed": 0, "ttft_ms": {"mean": 20.0, "min": 18.0, "p50": 19.0, "max": 23.0},
            "server": {"ttft_ms_by_role": {"prefill": 15.0, "router": 18.5}}}
    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"args": args, "idle_ttft": idle if name == "a" else None,
             "runs": [{"request_rate": 4.0, "results": summary}, {"request_rate": 8.0, "results": summary}]}))
    table = compare([f"disagg={tmp_path / 'a.json'}", f"colo={tmp_path / 'b.json'}"])
    rows = [line for line in table.splitlines() if line.startswith("|") and "---" not in line][1:]
    assert [r.split("|")[1].strip() for r in rows] == ["disagg", "disagg", "colo", "colo"]
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert cells == ["disagg", "4", "6 / 1", "125.0 / 368.8", "15.6 / 62.5", "21.5 / 61.2", "2.00", "57%", "12"]
    assert "disagg: idle TTFT (512-token prompt) p50 19.0 ms (min 18.0, max 23.0; 3 ok); the server's own mean: " \
           "prefill 15.0 ms, router 18.5 ms" in table
    assert "TPOT <= 31.25 ms): 8 req/s" in table and "colo: idle TTFT (512-token prompt) -;" in table
