"""Every message that crosses a socket, as msgspec Structs, with one typed decoder per direction.

Client <-> scheduler messages are tagged unions so one ROUTER socket can serve them all.
Scheduler <-> worker messages are positional arrays (array_like) since they go every step.
"""
from __future__ import annotations

import msgspec
from spmd_runtime.protocol.buckets import PhaseBuckets
from spmd_runtime.protocol.config_fields import VictimPolicy as VictimPolicy  # re-exported
from spmd_runtime.protocol.engine_stats import EngineStats
from spmd_runtime.protocol.engine_stats import ThermalEvent as ThermalEvent  # re-exported
from spmd_runtime.protocol.job_messages import (  # re-exported: the launchers' messages
    EndJob as EndJob,
)
from spmd_runtime.protocol.job_messages import NodeHeartbeat as NodeHeartbeat
from spmd_runtime.protocol.job_messages import StartWorkers as StartWorkers
from spmd_runtime.protocol.job_messages import WorkerAlive as WorkerAlive
from spmd_runtime.protocol.job_messages import WorkersLost as WorkersLost
from spmd_runtime.protocol.job_messages import _Wire
from spmd_runtime.protocol.logprobs import StepLogprobs, TokenLogprobs
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.step_shape import Phase, StepShape

# ---------------------------------------------------------------- client -> scheduler

class ChatMessage(msgspec.Struct, array_like=True, gc=False, forbid_unknown_fields=True):
    """One turn of a conversation, as the model's chat template takes it."""

    role: str
    content: str


class AddRequest(_Wire, tag="add"):
    """Submit a prompt. `tag` is the client's own correlation number for the reply.

    The prompt is one of: token ids; `prompt`, a text the scheduler tokenizes with the model's
    tokenizer (special tokens added as the tokenizer does by default); or `messages`, a
    conversation the scheduler renders with the model's chat template, ready for the reply.
    """

    tag: int
    prompt_token_ids: list[int] = []
    params: SamplingParams = SamplingParams()
    request_id: int | None = None
    # Larger is more important; thermal eviction with lowest_priority victims uses it.
    priority: int = 0
    # Seconds the request may take from acceptance; then it ends with finish_reason "timeout".
    timeout_s: float | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Whether the deltas carry text (when the scheduler has a tokenizer); a client that
    # detokenizes by itself saves the scheduler the work.
    detokenize: bool = True
    # Whether a delta follows every step that adds tokens. False: the whole output in one delta
    # when the request ends, for a client that waits for it (generate()), sparing it a wakeup
    # and the scheduler a frame each step. A request with stop strings streams regardless
    # (they are matched on its text as it comes).
    stream: bool = True


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


class Ping(_Wire, tag="ping"):
    """Is the scheduler alive? Answered with Pong at once, even in the middle of a step."""

    tag: int


class AdminBatchRequest(_Wire, tag="admin_batch"):
    """Operator control of the running batch. Every field left None is left as it is.

    force_evict takes that many running requests off the batch now (through preemption: they
    complete later); without max_num_seqs it also lowers max_num_seqs to the new running count
    so they do not come straight back. target_temp_c moves the thermal policy's target. policy
    picks this call's victims. dry_run changes nothing and answers what would happen.
    """

    tag: int
    token: str = ""
    max_num_seqs: int | None = None
    force_evict: int | None = None
    target_temp_c: float | None = None
    policy: VictimPolicy | None = None
    dry_run: bool = False


ClientMessage = (AddRequest | AbortRequest | StatsRequest | ModelInfoRequest
                 | ResetPrefixCacheRequest | AdminBatchRequest | Ping)


# ---------------------------------------------------------------- scheduler -> client

class RequestAccepted(_Wire, tag="accepted"):
    tag: int
    request_id: int
    # The prompt as the scheduler tokenized it (text and chat prompts only).
    prompt_token_ids: list[int] = []


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens of one request since the last delta; finish_reason set on the last one.

    text is the new text of the output (special tokens skipped), decoded incrementally by the
    scheduler when it has the model's tokenizer: the texts of a request's deltas add up to its
    whole output's text. Text that may be an incomplete character waits for the next delta.
    """

    request_id: int
    token_ids: list[int]
    finish_reason: str | None = None
    text: str = ""
    # On a request's first delta: seconds from its arrival at the scheduler to its first
    # scheduled step (Prometheus' request queue time).
    queue_time_s: float | None = None
    # With SamplingParams.logprobs: one record per token of token_ids. With prompt_logprobs, on
    # a request's first delta: one per prompt token, None for the first (nothing precedes it).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class Outputs(_Wire, tag="outputs"):
    """All deltas for one client from one step, in a single frame."""

    deltas: list[RequestDelta]


class AbortDone(_Wire, tag="aborted"):
    tag: int
    request_id: int


class Done(_Wire, tag="done"):
    """A control request succeeded."""

    tag: int


class Pong(_Wire, tag="pong"):
    tag: int


class AdminBatchReply(_Wire, tag="admin_batch_reply"):
    tag: int
    previous_running: int
    new_running: int
    evicted_request_ids: list[int]
    new_max_num_seqs: int
    # Measured group power per running request times the evictions; None without a power reading.
    estimated_watts_saved: float | None
    dry_run: bool = False


class ModelInfo(_Wire, tag="model_info_reply"):
    tag: int
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    world_size: int
    # The name clients address the model by (--served-model-name, else derived from --model).
    served_model_name: str = ""


class ErrorReply(_Wire, tag="error"):
    """A request or frame was refused; tag is None when the frame could not be decoded at all."""

    tag: int | None
    message: str
    request_id: int | None = None
    # Set where the kind matters to a client: "forbidden" (bad or missing admin token),
    # "disabled" (admin calls are off).
    code: str | None = None


ServerMessage = (RequestAccepted | Outputs | AbortDone | Done | EngineStats | ModelInfo | ErrorReply
                 | AdminBatchReply | Pong)


# ---------------------------------------------------------------- scheduler <-> worker

class WorkerLoaded(_Wire, tag="loaded"):
    """Sent once by every rank after its model is loaded and its KV cache allocated; the
    scheduler answers with the WarmupPlan, derived from the first rank to load."""

    rank: int
    max_model_len: int             # the model's context length, within --max-model-len
    device: str
    generation: int = 0
    # Its attention reads each sequence's context length from a tensor (Triton, C++): decode
    # buckets then need no context dimension.
    context_from_tensors: bool = False


class WarmupPlan(_Wire, tag="warmup"):
    """The scheduler's buckets by phase, the same for every rank: what
    it warms up (and captures) before reporting ready. None: bucketing is off."""

    buckets: dict[Phase, PhaseBuckets] | None = None


class WorkerReady(_Wire, tag="ready"):
    """Sent once by every rank after warming up the WarmupPlan's buckets."""

    rank: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    num_cpu_kv_blocks: int = 0     # the swap space, in blocks
    thermal_sensor: str = "none"   # the sensor kind this rank reads: nvml, psutil, file, none
    generation: int = 0            # which start of the worker group (0, then 1 after a restart...)
    # The sliding window of a model whose every layer has one, or of the windowed layers of one
    # that mixes them (0: none): the scheduler frees the blocks that leave it.
    sliding_window: int = 0
    # A model mixing them: the blocks of its windowed layers' cache (0: one pool for all).
    num_sliding_kv_blocks: int = 0


# A block-table entry whose block left the sliding window and went back to the pool (in
# NewRequestData.block_ids: attention never reads it).
FREED_BLOCK = -1


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
    # How many of token_ids are the prompt (the rest were generated); -1: all of them.
    num_prompt_tokens: int = -1
    # A model mixing full and sliding-window layers: the block table of its windowed layers.
    sliding_block_ids: list[int] = []


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
    # ... and those of the windowed layers' pool, for a model mixing full and sliding-window
    # layers (swap_out and swap_in are then the full layers' pool's).
    swap_out_sliding: list[tuple[int, int]] = []
    swap_in_sliding: list[tuple[int, int]] = []
    # With bucketing: ("prompt", batch size, sequence length) or ("decode", batch size, context
    # length) every rank pads this step to; None runs it unpadded.
    bucket: StepShape | None = None
    # Structured outputs: (request id, bitmask) of each constrained request sampling this step,
    # bit t of little-endian 32-bit word t // 32 set where token t is allowed; for one verifying
    # proposals, a bitmask per row of them, concatenated.
    token_masks: list[tuple[int, bytes]] = []
    # Speculative decoding: (request id, proposed tokens) of each request that verifies
    # proposals in this step. Its scheduled tokens are its last known token and these.
    spec_token_ids: list[tuple[int, list[int]]] = []
    # Speculative decoding with a draft model: (request id, tokens to propose) of each request
    # whose proposals the workers' draft model makes this step; scheduled as above.
    draft_lengths: list[tuple[int, int]] = []
    # ... and (request id, tokens to propose) of each request whose draft model proposes after
    # the token it samples this step, once sampled: for the next step, where the scheduler
    # trims them to what the request's grammar allows (structured outputs).
    draft_after: list[tuple[int, int]] = []
    # A model mixing full and sliding-window layers: (request id, blocks appended since last
    # step) of the running requests whose windowed layers' table grew.
    cached_new_sliding_block_ids: list[tuple[int, list[int]]] = []


class ThermalReading(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The group's temperatures at one step, all-reduced (MAX) across the ranks."""

    max_temp_c: float
    hottest_rank: int
    temps_c: list[float | None]      # per rank; None where a rank has no reading
    power_w: float | None = None     # the group's total draw, from the ranks that report one


class StepResult(_Wire, tag="result"):
    """Rank 0's answer: one sampled token for each request whose scheduled tokens reached its end
    (one or more for a request that verified proposals)."""

    step_id: int
    request_ids: list[int]
    sampled_token_ids: list[int]
    forward_ms: float       # rank 0's device time for the step (CUDA: events; CPU: forward + sampling)
    prepare_ms: float
    # Graph captures or compilations this step needed after warmup (a shape nobody warmed up).
    num_compilations: int = 0
    # Set on steps that read the sensors (every --thermal-interval-steps) when any rank has a reading.
    thermal: ThermalReading | None = None
    # The device's idle time between the step launched before it and this one (CUDA: timed by
    # events, as forward_ms is; None: no step before it).
    idle_ms: float | None = None
    # Launched behind the step before it, before that one was finished (--step-pipelining overlap).
    overlapped: bool = False
    # For the requests that asked for logprobs or prompt_logprobs (SamplingParams).
    logprobs: list[StepLogprobs] = []
    # Speculative decoding: (request id, its output tokens: the proposals accepted, then the
    # target's own next token) of each request that verified proposals; such a request is not
    # in request_ids.
    spec_token_ids: list[tuple[int, list[int]]] = []
    # The draft model's proposals of the plan's draft_after requests: (request id, tokens).
    draft_proposals: list[tuple[int, list[int]]] = []


class WorkerError(_Wire, tag="worker_error"):
    rank: int
    message: str
    generation: int = 0


class Shutdown(_Wire, tag="shutdown"):
    reason: str = ""


class Heartbeat(_Wire, tag="heartbeat"):
    """The scheduler is alive (sent every second when no plan went out): workers that hear
    nothing for --heartbeat-timeout-s exit."""


SchedulerToWorker = StepPlan | WarmupPlan | Shutdown | Heartbeat
SchedulerToLauncher = StartWorkers | EndJob | Heartbeat
WorkerToScheduler = (WorkerLoaded | WorkerReady | StepResult | WorkerError | WorkersLost
                     | NodeHeartbeat | WorkerAlive)


# What decoding an untrusted frame can raise: msgpack strings with invalid UTF-8 surface as
# UnicodeDecodeError rather than as msgspec's own errors, and deeply nested arrays decoded
# without a type as RecursionError.
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError,
                 RecursionError)


def client_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ClientMessage)


def server_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ServerMessage)


def worker_inbound_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(SchedulerToWorker)


def launcher_inbound_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(SchedulerToLauncher)


def scheduler_inbound_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(WorkerToScheduler)
