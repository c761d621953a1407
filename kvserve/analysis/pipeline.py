"""Pipeline parallelism's bubble (seed 004's parallelism: "pipeline parallelism splits the layers";
GPipe's schedule): P stages each taking t per micro-batch, M micro-batches through them in a step.

The step takes (M + P - 1) t, of which each stage works M t, so a fraction (P - 1) / (M + P - 1)
of every stage's time is bubble; against one process doing all P stages' work (P t per
micro-batch, M P t in all) the pipeline is P M / (M + P - 1) times as fast, before the hand-offs.
kvserve's pipeline (kvserve/distributed/pipeline.py) has one step in flight: M = 1, bubble
(P - 1) / P, speed 1x of one process on one of the P devices.
"""
from __future__ import annotations


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of each stage's time spent idle in one step."""
    if stages < 1 or microbatches < 1:
        raise ValueError("stages and microbatches must be >= 1")
    return (stages - 1) / (microbatches + stages - 1)


def pipeline_speedup(stages: int, microbatches: int, handoff_frac: float = 0.0) -> float:
    """Throughput against one process holding every layer on one of the stages' devices;
    `handoff_frac`: each hand-off's time as a fraction of one stage's work per micro-batch."""
    busy = 1.0 - bubble_fraction(stages, microbatches)
    return stages * busy / (1.0 + handoff_frac)


def measured_bubble(pp_tok_s: float, one_device_tok_s: float, stages: int) -> float:
    """The bubble a measurement implies: a bubble-free pipeline would serve `stages` times what one
    process on one stage's device serves (`one_device_tok_s`); the rest of each stage's time idled
    or went to hand-offs."""
    return 1.0 - pp_tok_s / (stages * one_device_tok_s)
