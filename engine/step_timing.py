"""Where an engine step's time goes (issue 13): the host's phases, and the GPU's own time.

EngineCore.step and ModelRunner.execute_model add to one StepTimes per engine (`core.times`):

  schedule   Scheduler.schedule
  prepare    the runner's inputs built on the host (block tables, positions, slots)
  launch     forward and sampler handed to the GPU (graph replay, or eager kernel launches)
  wait       the host waiting for sampled tokens (a step's one sync)
  post       the runner after the sync (tokens appended, logprobs)
  update     Scheduler.update_from_output (finishes, stop checks, outputs)
  gpu        CUDA-event time from the forward's start (or, when it was launched while the step
             before still ran, from that step's end) to the sampled tokens (only with
             `gpu_events`: two events per step; 0 on CPU)

The host phases are back to back, so their sum is the steps' wall time. With async scheduling
a step() launches one step and collects the one before: `wait` is then for the previous step's
tokens while this one is already queued. `wait` is what the GPU makes the host wait; wall minus
gpu is, roughly, the time the GPU sat idle (the host work the GPU did not overlap). `steps`
counts steps that ran something (the last call of a run only collects).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PHASES = ("schedule", "prepare", "launch", "wait", "post", "update")


@dataclass
class StepTimes:
    steps: int = 0
    graph_steps: int = 0        # run as CUDA graphs: the decode graph, or cut at attention
    piecewise_steps: int = 0    # of them, cut at attention (steps with prompt chunks)
    schedule: float = 0.0       # seconds, summed over the steps
    prepare: float = 0.0
    launch: float = 0.0
    wait: float = 0.0
    post: float = 0.0
    update: float = 0.0
    gpu: float = 0.0
    graph_gpu: float = 0.0
    piecewise_gpu: float = 0.0
    gpu_events: bool = False    # time the GPU too (CUDA events); off by default

    def copy(self) -> StepTimes:
        return dataclasses.replace(self)

    def since(self, earlier: StepTimes) -> StepTimes:
        """What was added after `earlier` (a copy taken then)."""
        return StepTimes(**{f.name: getattr(self, f.name) - getattr(earlier, f.name)
                            for f in dataclasses.fields(self) if f.name != "gpu_events"},
                         gpu_events=self.gpu_events)

    def wall_s(self) -> float:
        """Seconds spent in steps: every phase, summed."""
        return sum(getattr(self, p) for p in PHASES)

    def per_step_ms(self) -> dict[str, float]:
        """Mean milliseconds per step of each phase, the wall time, the GPU's time (in all, per
        decode graph step, per step cut at attention (piecewise) and per other (eager) step),
        the share of steps that ran as CUDA graphs (either kind) and of those cut at attention."""
        n = max(self.steps, 1)
        out = {p: round(1e3 * getattr(self, p) / n, 4) for p in PHASES}
        out["wall"] = round(sum(out[p] for p in PHASES), 4)
        if self.gpu_events and self.gpu > 0:    # CPU, or not asked: no GPU figure
            out["gpu"] = round(1e3 * self.gpu / n, 4)
            decode_graphs = self.graph_steps - self.piecewise_steps
            if decode_graphs:
                out["gpu_graph_step"] = round(1e3 * (self.graph_gpu - self.piecewise_gpu)
                                              / decode_graphs, 4)
            if self.piecewise_steps:
                out["gpu_piecewise_step"] = round(1e3 * self.piecewise_gpu / self.piecewise_steps, 4)
            if self.steps > self.graph_steps:
                out["gpu_other_step"] = round(1e3 * (self.gpu - self.graph_gpu)
                                              / (self.steps - self.graph_steps), 4)
        out["graph_step_share"] = round(self.graph_steps / n, 4)
        out["piecewise_step_share"] = round(self.piecewise_steps / n, 4)
        return out
