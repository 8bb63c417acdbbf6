"""Every message that crosses a socket, as msgspec Structs, with one typed decoder per direction.

Client <-> scheduler messages are tagged unions so one ROUTER socket can serve them all.
Scheduler <-> worker messages are positional arrays (array_like) since they go every step.
"""
from __future__ import annotations

import msgspec

from protocol.sampling import SamplingParams


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of every tagged message: compact positional encoding, no GC tracking."""


# ---------------------------------------------------------------- client -> scheduler

class AddRequest(_Wire, tag="add"):
    """Submit a prompt. `tag` is the client's own correlation number for the reply."""

    tag: int
    prompt_token_ids: list[int]
    params: SamplingParams = SamplingParams()
    request_id: int | None = None


class AbortRequest(_Wire, tag="abort"):
    tag: int
    request_id: int


class StatsRequest(_Wire, tag="stats"):
    tag: int


class ResetPrefixCacheRequest(_Wire, tag="reset_prefix_cache"):
    """Forget every cached prefix; refused while any block is in use."""

    tag: int


class ModelInfoRequest(_Wire, tag="model_info"):
    """Also serves as the readiness probe: answered only once every worker is ready."""

    tag: int


ClientMessage = AddRequest | AbortRequest | StatsRequest | ModelInfoRequest | ResetPrefixCacheRequest


# ---------------------------------------------------------------- scheduler -> client

class RequestAccepted(_Wire, tag="accepted"):
    tag: int
    request_id: int


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens of one request since the last delta; finish_reason set on the last one."""

    request_id: int
    token_ids: list[int]
    finish_reason: str | None = None


class Outputs(_Wire, tag="outputs"):
    """All deltas for one client from one step, in a single frame."""

    deltas: list[RequestDelta]


class AbortDone(_Wire, tag="aborted"):
    tag: int
    request_id: int


class Done(_Wire, tag="done"):
    """A control request succeeded."""

    tag: int


class EngineStats(_Wire, tag="stats_reply"):
    tag: int
    num_waiting: int
    num_running: int
    num_preempted: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_in_use: int
    num_steps: int
    num_finished: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_preemptions: int               # swaps out + soft resets
    num_swapped: int                   # requests whose KV blocks wait in the CPU pool now
    num_swaps_out: int
    num_swaps_in: int
    num_soft_resets: int               # preemptions that dropped the KV cache (recompute)
    cpu_kv_blocks_total: int
    cpu_kv_blocks_free: int
    scheduler: str
    bucketing: bool
    batches_outside_buckets: int       # bucketed engines: batches larger than every bucket
    padding_waste: float               # padded tokens / computed tokens of bucketed steps
    runtime_graph_compilations: int    # compilations or captures after warmup
    prefix_caching: bool
    prefix_cache_queries: int          # prompt tokens looked up at admission
    prefix_cache_hits: int             # of those, tokens served from the cache
    prefix_cache_hit_rate: float
    kv_blocks_cached: int              # blocks holding a hashed, reusable prefix
    maintenance_ms: float              # scheduler bookkeeping done during steps, in total
    maintenance_hidden_ms: float       # of that, overlapped with the workers' forward passes


class ModelInfo(_Wire, tag="model_info_reply"):
    tag: int
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    world_size: int


class ErrorReply(_Wire, tag="error"):
    """A request or frame was refused; tag is None when the frame could not be decoded at all."""

    tag: int | None
    message: str
    request_id: int | None = None


ServerMessage = RequestAccepted | Outputs | AbortDone | Done | EngineStats | ModelInfo | ErrorReply


# ---------------------------------------------------------------- scheduler <-> worker

class WorkerReady(_Wire, tag="ready"):
    """Sent once by every rank after its model is loaded and its KV cache allocated."""

    rank: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    num_cpu_kv_blocks: int = 0     # the swap space, in blocks


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the workers do not hold: new, resumed after a soft reset, or swapped back in.

    token_ids is the prompt plus any tokens generated before a preemption. Blocks past
    num_computed_tokens are fresh; a swapped-in request's computed blocks are filled by the
    plan's swap_in copies.
    """

    request_id: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    params: SamplingParams


class StepPlan(_Wire, tag="plan"):
    """One step. Requests the workers already hold travel as columns of deltas only."""

    step_id: int
    new_requests: list[NewRequestData]
    # Running requests, columnar: id, tokens to compute this step, blocks appended since last step.
    cached_request_ids: list[int]
    cached_num_scheduled_tokens: list[int]
    cached_new_block_ids: list[list[int]]
    # Requests the workers must forget (finished, aborted, or preempted).
    dropped_request_ids: list[int] = []
    # KV block copies as (device block, CPU block) pairs, done by every rank before the forward
    # pass in this order: swap_out (device -> CPU), clearing fresh blocks, swap_in (CPU -> device).
    swap_out: list[tuple[int, int]] = []
    swap_in: list[tuple[int, int]] = []
    # With bucketing: ("prompt", batch size, sequence length) or ("decode", batch size, context
    # length) every rank pads this step to; None runs it unpadded.
    bucket: tuple[str, int, int] | None = None


class StepResult(_Wire, tag="result"):
    """Rank 0's answer: one sampled token for each request whose scheduled tokens reached its end."""

    step_id: int
    request_ids: list[int]
    sampled_token_ids: list[int]
    forward_ms: float
    prepare_ms: float
    # Graph captures or compilations this step needed after warmup (a shape nobody warmed up).
    num_compilations: int = 0


class WorkerError(_Wire, tag="worker_error"):
    rank: int
    message: str


class Shutdown(_Wire, tag="shutdown"):
    reason: str = ""


SchedulerToWorker = StepPlan | Shutdown
WorkerToScheduler = WorkerReady | StepResult | WorkerError


# What decoding an untrusted frame can raise: msgpack strings with invalid UTF-8 surface as
# UnicodeDecodeError rather than as msgspec's own errors.
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError)


def client_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ClientMessage)


def server_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ServerMessage)


def worker_inbound_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(SchedulerToWorker)


def scheduler_inbound_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(WorkerToScheduler)
