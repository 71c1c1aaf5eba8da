"""scripts/sim_closed_loop.py: the real scheduler on a simulated clock. A client that takes
longer than a decode-only step to send its next request misses the plan of the step after its
predecessor finished and waits a whole (mixed) step more for its first token, at the same
throughput."""
from scripts import sim_closed_loop


def test_a_slower_reissue_costs_a_step_of_ttft_not_throughput(capsys):
    args = dict(c=32, prompt=64, output=16, num_requests=32 * 6, reply_ms=0.0, base_ms=8.0,
                per_token_us=21.0, budget=512, async_lag=2)
    fast = sim_closed_loop.simulate(send_ms=0.5, **args)
    slow = sim_closed_loop.simulate(send_ms=30.0, **args)
    # a 512-token step: 8 + 10.8 ms; a decode-only one: 8.7 ms
    assert slow["ttft_p50_ms"] >= fast["ttft_p50_ms"] + 8.0, (fast, slow)
    assert slow["output_tok_s"] > 0.8 * fast["output_tok_s"]
    rows = sim_closed_loop.main(["--concurrency", "8", "--prompt", "16", "--output", "4",
                                 "--waves", "3", "--send-ms", "1", "--reply-ms", "0"])
    assert len(rows) == 1 and rows[0]["ttft_p50_ms"] > 0
    assert "| 2 | 1 | 0 |" in capsys.readouterr().out
