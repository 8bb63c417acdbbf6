"""One request's state as the scheduler sees it: tokens, blocks, lifecycle."""
from __future__ import annotations

import enum
import time

from spmd_runtime.protocol.logprobs import StepLogprobs, TokenLogprobs
from spmd_runtime.protocol.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"    # soft reset: no KV left, recomputed from prompt + output
    SWAPPED = "swapped"        # its KV blocks wait in the CPU swap space
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS or a stop token
    LENGTH = "length"    # max_tokens or the context limit
    ABORT = "abort"      # the client aborted it
    TIMEOUT = "timeout"  # its deadline (timeout_s in the request) passed
    ERROR = "error"      # the engine failed while it ran


class Request:
    __slots__ = ("request_id", "prompt_token_ids", "params", "client", "output_token_ids",
                 "status", "finish_reason", "num_computed_tokens", "block_ids",
                 "num_blocks_sent", "known_to_workers", "num_tokens_streamed", "arrival_seq",
                 "block_hashes", "num_cached_blocks", "cpu_block_ids", "priority", "arrival_time",
                 "queue_time_s", "output_logprobs", "prompt_logprobs", "draft_length",
                 "num_blocks_slid", "sliding", "drafted", "stream")

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                 client: bytes = b"", arrival_seq: int = 0, priority: int = 0) -> None:
        self.request_id = request_id
        # Larger is more important (thermal eviction with lowest_priority victims).
        self.priority = priority
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.client = client
        self.arrival_seq = arrival_seq
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # Under a sliding window on every layer: how many of block_ids, from the first, left the
        # window and went back to the pool (their entries are then FREED_BLOCK).
        self.num_blocks_slid = 0
        # A model mixing full and sliding-window layers: its windowed layers' block table
        # (scheduler_proc.kv_groups.SlidingTable), made at its first allocation.
        self.sliding = None
        # How many of block_ids the workers already hold; the rest travel in the next plan.
        self.num_blocks_sent = 0
        self.known_to_workers = False
        self.num_tokens_streamed = 0
        # False: its deltas wait for its end (AddRequest.stream).
        self.stream = True
        # Chained hashes of its full blocks (prefix caching), and how many of its blocks are cached.
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        # While swapped out: the CPU blocks holding its computed KV, in block-table order.
        self.cpu_block_ids: list[int] = []
        # time.monotonic() on arrival, and the seconds it waited before its first step.
        self.arrival_time = time.monotonic()
        self.queue_time_s: float | None = None
        # With params.logprobs: one record per output token. With params.prompt_logprobs: one
        # per prompt token, None for the first, filled as prefill chunks are computed.
        self.output_logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs | None] = [None]
        # Speculative decoding: how many tokens it proposes next (0: the most allowed); and a
        # draft model's proposals after its last token, made after the step that sampled it
        # (a request under a structured output: StepPlan.draft_after).
        self.draft_length = 0
        self.drafted: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def samples_after(self, num_tokens: int) -> bool:
        """Whether computing `num_tokens` more reaches its last known token, so it samples."""
        return self.num_computed_tokens + num_tokens == self.num_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def note_logprobs(self, record: StepLogprobs | None) -> None:
        """Keep what a step computed for this request. Prompt records of a recomputation (after
        a preemption) replace the same positions' first ones."""
        if record is None:
            return
        if record.prompt and record.prompt_start <= len(self.prompt_logprobs):
            start = record.prompt_start
            self.prompt_logprobs[start:start + len(record.prompt)] = record.prompt
        if record.sampled is not None:
            self.output_logprobs.append(record.sampled)
        self.output_logprobs.extend(record.verified)

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, prompt={len(self.prompt_token_ids)}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})")
