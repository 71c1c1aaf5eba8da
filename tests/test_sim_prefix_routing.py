"""scripts/sim_prefix_routing.py: the real schedulers and prefix routers on a simulated clock.
Whole groups per engine compute each prefix once; without routing each engine computes it; the
router keeps groups whole as far as its slack lets it."""
from scripts import sim_prefix_routing as sim

ARGS = dict(engines=2, c=32, num_requests=32 * 4, group_size=8, shared=128, own=32, output=8,
            max_num_seqs=16, budget=256, num_blocks=4000, base_ms=2.0, per_row_us=34.0,
            per_token_us=24.0, eager_ms=2.5, send_ms=1.0, reply_ms=1.0)
PROMPT = 128 + 32


def test_whole_groups_compute_a_prefix_once_and_split_ones_once_per_engine():
    direct = sim.simulate("direct", None, **ARGS)
    none = sim.simulate("none", None, **ARGS)
    assert direct["hit_ratio"] == round(1 - (128 + 8 * 32) / (8 * PROMPT), 3)      # 0.7
    assert none["hit_ratio"] == round(1 - (2 * 128 + 8 * 32) / (8 * PROMPT), 3)    # 0.6
    assert direct["output_tok_s"] > none["output_tok_s"]
    # Four clients, each sending its own prompts (i, i + 4, ...): every prompt is sent once.
    assert sim.simulate("direct", None, clients=4, **ARGS)["hit_ratio"] == direct["hit_ratio"]


def test_the_router_keeps_groups_whole_as_far_as_its_slack_lets_it():
    none = sim.simulate("none", None, **ARGS)
    whole = sim.simulate("routing", 10 ** 6, **ARGS)
    some = sim.simulate("routing", 4, **ARGS)
    assert whole["hit_ratio"] == sim.simulate("direct", None, **ARGS)["hit_ratio"]
    assert none["hit_ratio"] < some["hit_ratio"] < whole["hit_ratio"]
    assert some["output_tok_s"] > none["output_tok_s"]


def test_main_prints_a_row_per_mode_and_slack(capsys):
    rows = sim.main(["--concurrency", "16", "--max-num-seqs", "8", "--waves", "2",
                     "--group-size", "4", "--shared", "64", "--own", "16", "--output", "4",
                     "--num-blocks", "2000", "--slack", "2", "8"])
    assert [(r["mode"], r["slack"]) for r in rows] == [
        ("direct", None), ("none", None), ("routing", 2), ("routing", 8)]
    assert capsys.readouterr().out.count("\n| routing | ") == 2


def test_by_default_each_engine_may_run_every_stream_and_the_router_keeps_its_slack():
    """As bench_serving.py sets it: max_num_seqs is the concurrency; the slack the router's own
    default, max_num_seqs / 2."""
    rows = sim.main(["--concurrency", "16", "--waves", "2", "--group-size", "4", "--shared", "64",
                     "--own", "16", "--output", "4", "--num-blocks", "2000",
                     "--modes", "routing"])
    assert [(r["mode"], r["slack"], r["max_num_seqs"]) for r in rows] == [("routing", 8, 16)]


def test_the_engines_schedulers_take_the_prefill_hold():
    """--hold reaches each engine's Scheduler: held prompts start later (a longer TTFT) and
    the row says the setting."""
    off = sim.simulate("direct", None, **ARGS)
    held = sim.simulate("direct", None, hold=4, **ARGS)
    assert (off["prefill_hold_steps"], held["prefill_hold_steps"]) == (0, 4)
    assert held["ttft_p50_ms"] > off["ttft_p50_ms"]
    assert held["hit_ratio"] == off["hit_ratio"]


def test_streams_stepping_through_their_clients_prompts_on_their_own_send_each_once():
    """--per-stream (perf_analyzer's order): every prompt is still sent once (simulate checks
    that every request finished), whole groups still compute each prefix once, and a jittered
    send still lets the router keep more groups whole than no routing."""
    direct = sim.simulate("direct", None, **ARGS)
    for clients in (1, 4):
        walked = sim.simulate("direct", None, clients=clients, per_stream=True, **ARGS)
        assert walked["hit_ratio"] == direct["hit_ratio"]
    none = sim.simulate("none", None, per_stream=True, send_jitter_ms=2.0, **ARGS)
    routed = sim.simulate("routing", 10 ** 6, per_stream=True, send_jitter_ms=2.0, **ARGS)
    assert none["hit_ratio"] < routed["hit_ratio"] <= direct["hit_ratio"]
    late = sim.simulate("routing", 10 ** 6, per_stream=True, send_jitter_ms=50.0, **ARGS)
    assert late["ttft_p50_ms"] > routed["ttft_p50_ms"] + 20      # a send's delay is in its TTFT
