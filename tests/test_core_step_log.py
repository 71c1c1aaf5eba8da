"""scripts/core_step_log.py reads the lines the engine core's step log writes."""
import logging
from types import SimpleNamespace

from engine.core_process import _StepLog
from engine.scheduler import SchedulerStats
from engine.step_timing import StepTimes
from scripts.core_step_log import caveats, parse, summarize


def _core_lines(pid, steps, graph_steps, gpu_s, graph_gpu_s, prompt, generated,
                piecewise_steps=0, piecewise_gpu_s=0.0):
    """One line of a core's step log, as the core process formats it."""
    core = SimpleNamespace(times=StepTimes(), scheduler=SimpleNamespace(
        stats=SchedulerStats(), num_running=250, num_waiting=3))
    log = _StepLog(core, 1e-9)                  # a line at every add
    core.times = StepTimes(steps=steps, graph_steps=graph_steps, schedule=0.01, launch=0.05,
                           wait=0.1, gpu=gpu_s, graph_gpu=graph_gpu_s, gpu_events=True,
                           piecewise_steps=piecewise_steps, piecewise_gpu=piecewise_gpu_s)
    core.scheduler.stats.num_computed_prompt_tokens = prompt
    core.scheduler.stats.num_cached_prompt_tokens = 5 * prompt
    core.scheduler.stats.num_generated_tokens = generated
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    handler.setFormatter(logging.Formatter(f"core[{pid}] %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("engine.core_process")
    logger.addHandler(handler)
    old_level, logger.level = logger.level, logging.INFO
    try:
        log.add("step", True)
    finally:
        logger.removeHandler(handler)
        logger.level = old_level
    return [handler.format(r) for r in records]


def test_step_log_lines_add_up_per_kind_of_step():
    lines = (_core_lines(11, 10, 6, 0.2, 0.06, 3000, 9000)       # 6 x 10 ms, 4 x 35 ms
             + _core_lines(12, 20, 10, 0.5, 0.1, 5000, 11000)    # 10 x 10 ms, 10 x 40 ms
             + _core_lines(12, 3, 0, 0.3, 0.0, 4000, 20)         # ramping up: not busy
             + ["core[13] INFO engine.models.loader: loaded", "I1130 server line"])
    cores = parse(lines)
    assert sorted(cores) == ["11", "12"] and len(cores["12"]) == 2
    first = cores["11"][0]
    assert (first["steps"], first["running"], first["waiting"]) == (10, 250, 3)
    assert (first["prompt"], first["cached"], first["generated"]) == (3000, 15000, 9000)
    assert first["phases"]["gpu_graph_step"] == 10.0
    s = summarize(cores)
    assert s == {"cores": 2, "lines": 2, "graph_steps": 16, "graph_step_ms": 10.0,
                 "other_steps": 14, "other_step_ms": round((140 + 400) / 14, 2),
                 "other_steps_piecewise": 0,
                 "prompt_tokens_per_other_step": round(8000 / 14), "graph_share": 0.533,
                 "gpu_ms_per_generated_token": round(700 / 20000, 4),
                 "prompt_tokens_per_generated_token": 0.4}
    assert summarize(cores, min_generated=10)["lines"] == 3


def test_steps_cut_at_attention_count_with_the_steps_carrying_prompts():
    """Graph steps cut at attention carry prompt chunks: they are summed with the eager steps,
    not with the decode graphs."""
    # 10 steps: 4 decode graphs x 10 ms, 5 cut at attention x 30 ms, 1 eager x 50 ms.
    cores = parse(_core_lines(11, 10, 9, 0.24, 0.19, 6000, 9000, piecewise_steps=5,
                              piecewise_gpu_s=0.15))
    s = summarize(cores)
    assert (s["graph_steps"], s["graph_step_ms"]) == (4, 10.0)
    assert (s["other_steps"], s["other_steps_piecewise"], s["other_step_ms"]) == (6, 5, 33.33)
    assert s["prompt_tokens_per_other_step"] == 1000 and s["graph_share"] == 0.4


def test_lines_without_gpu_times_give_nothing():
    """On CPU the core's log has no GPU time: nothing to sum."""
    cores = parse(_core_lines(11, 10, 0, 0.0, 0.0, 100, 9000))
    assert cores and summarize(cores) == {}


def test_logs_of_the_earlier_labels_are_said_to_be_so():
    """Logs written before piecewise_step_share (every graph step counted as a decode graph),
    and from 2592aaa to 7acd8ee (decode graph steps counted as cut when they fit the cut
    graphs), cannot be split right: the summary says so. A log of today's labels gets no
    caveat."""
    today = summarize(parse(_core_lines(11, 10, 9, 0.24, 0.19, 6000, 9000, piecewise_steps=5,
                                        piecewise_gpu_s=0.15)))
    assert caveats(today) == [] and caveats({}) == []
    # Every step counted as a graph step cut at attention: 8 decode steps and 2 with prompts.
    mislabelled = summarize(parse(_core_lines(11, 10, 10, 0.2, 0.2, 3000, 9000,
                                              piecewise_steps=10, piecewise_gpu_s=0.2)))
    assert mislabelled["graph_steps"] == 0
    assert len(caveats(mislabelled)) == 1 and "2592aaa to 7acd8ee" in caveats(mislabelled)[0]
    # Before the cut steps were told apart: every step a graph step, no step with prompts.
    before = summarize(parse(_core_lines(11, 10, 10, 0.2, 0.2, 3000, 9000)))
    assert len(caveats(before)) == 1 and "before the cores told" in caveats(before)[0]
