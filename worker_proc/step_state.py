"""What a worker keeps per request between steps, and a step's records from its preparation
to its output (built and read by worker_proc.model_runner.ModelRunner)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from spmd_runtime.protocol.logprobs import StepLogprobs
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.step_shape import StepShape
from spmd_runtime.worker_proc.graphs import BucketGraph, StaticInputs
from spmd_runtime.worker_proc.logprobs import LogprobRows

# Stands in token_ids for a token sampled by a step still in flight: its value is on the device
# (LaunchedStep.tokens), where the next step's inputs take it from, and reaches the host only
# when that step is finished. An input left holding it fails the embedding lookup.
UNREAD_TOKEN = -1


@dataclass
class RequestState:
    """What a worker keeps per request between steps (the scheduler sends only deltas); its
    block ids are kept by ModelRunner.block_tables."""

    token_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    num_prompt_tokens: int = -1         # -1: all of token_ids
    # (index in token_ids, row in the in-flight step's sampled tokens) of an UNREAD_TOKEN.
    unread: tuple[int, int] | None = None


@dataclass
class StepOutput:
    request_ids: list[int]
    sampled_token_ids: list[int]
    prepare_ms: float
    # Device time of the step: CUDA events from its first input copy to the sampled tokens'
    # copy back; on CPU, the forward pass and sampling.
    forward_ms: float
    num_compilations: int = 0
    # The device's idle time between the end of the step launched before it and its start.
    idle_ms: float | None = None
    overlapped: bool = False
    logprobs: list[StepLogprobs] = field(default_factory=list)
    # Speculative decoding: (request id, output tokens) of each request that verified proposals.
    spec_token_ids: list[tuple[int, list[int]]] = field(default_factory=list)
    # The draft model's proposals after each draft_after request's new token.
    draft_proposals: list[tuple[int, list[int]]] = field(default_factory=list)

    def describe(self) -> str:
        """One line for the worker's per-step debug log."""
        idle = "?" if self.idle_ms is None else f"{self.idle_ms:.2f}"
        return (f"forward {self.forward_ms:.2f} ms, device idle before it {idle} ms, "
                f"{'overlapped' if self.overlapped else 'not overlapped'}")


@dataclass(kw_only=True)
class PreparedStep:
    """A step's inputs, built on the host (possibly while the step before it still runs)."""

    scheduled: list[tuple[int, int]]
    bucket: StepShape | None
    graph: BucketGraph | None
    inputs: StaticInputs | None
    sample_rows: list[int]
    sample_ids: list[int]
    # Inputs that are tokens sampled by the step in flight: their positions in input_ids and
    # their rows in that step's sampled tokens. Filled on the device at launch.
    unread_positions: list[int]
    unread_rows: list[int]
    prepare_ms: float
    # Structured outputs: the bitmask of each constrained request sampling in this step.
    token_masks: dict[int, bytes] = field(default_factory=dict)
    # Speculative decoding: (request id, its last input row, its proposals) of each request
    # verifying proposals, whose rows are the last len(proposals) + 1 up to that one.
    spec: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # ... and (request id, tokens) of those whose draft model proposes after its new token.
    draft_after: list[tuple[int, int]] = field(default_factory=list)

    def describe(self) -> str:
        """One line for the worker's per-step debug log."""
        tokens = sum(n for _, n in self.scheduled)
        return (f"{len(self.scheduled)} requests, {tokens} tokens, bucket {self.bucket}, "
                f"{'graph' if self.graph is not None else 'eager'}, prepared in "
                f"{self.prepare_ms:.2f} ms")


@dataclass(kw_only=True)
class LaunchedStep:
    """A step queued on the device; `ModelRunner.finish` waits for it and reads its tokens."""

    sample_ids: list[int]
    # Where each sampled token goes: its request's state and the index of its UNREAD_TOKEN.
    token_slots: list[tuple[RequestState, int]]
    tokens: torch.Tensor | None         # sampled, on the device
    host_tokens: torch.Tensor | None    # their copy on the host, valid once the step is done
    prepare_ms: float
    num_compilations: int
    launched_at: float                  # perf_counter() when its first input was queued
    # CUDA: events around the step's device work; None on CPU, where launching runs it.
    started: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    finished_at: float = 0.0            # CPU: perf_counter() when its tokens were sampled
    idle_ms: float | None = None        # device idle time before it (CPU: known at launch)
    previous: LaunchedStep | None = None  # the step launched before it (CUDA idle time)
    overlapped: bool = False            # launched before the step before it was finished
    # Its sampled and prompt tokens' log-probabilities, on the device (None: nobody asked).
    logprobs: list[LogprobRows | None] = field(default_factory=list)
    # Speculative decoding's outputs, read back at launch: (request id, tokens).
    spec_token_ids: list[tuple[int, list[int]]] = field(default_factory=list)
    # The plan's draft_after: proposed once the step's tokens are read (finish).
    draft_after: list[tuple[int, int]] = field(default_factory=list)

    def is_done(self) -> bool:
        return self.done is None or self.done.query()
