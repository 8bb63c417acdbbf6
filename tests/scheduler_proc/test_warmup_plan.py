"""The buckets are derived once, in the scheduler (SchedulerServer._warmup_plan), and every
rank gets the same ones in its WarmupPlan (WorkerGroup.gather_ready), whatever each rank
reports or has in its own environment."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import msgspec
import zmq
from spmd_runtime.protocol.buckets import engine_buckets
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.config_resolve import environment_options
from spmd_runtime.protocol.messages import (
    WarmupPlan,
    WorkerLoaded,
    WorkerReady,
    worker_inbound_decoder,
)
from spmd_runtime.protocol.transport import Encoder
from spmd_runtime.scheduler_proc.server import SchedulerServer
from spmd_runtime.scheduler_proc.startup import derive_warmup_plan
from spmd_runtime.scheduler_proc.worker_group import WorkerGroup, worker_identity


def fake_rank(ctx: zmq.Context, address: str, rank: int, max_model_len: int,
              received: dict[int, WarmupPlan]) -> None:
    """A worker's start-up exchange: loaded, then the plan, then ready."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, worker_identity(rank))
    sock.connect(address)
    encode, decoder = msgspec.msgpack.encode, worker_inbound_decoder()
    sock.send(encode(WorkerLoaded(rank=rank, max_model_len=max_model_len, device="cuda:0")))
    while not isinstance(message := decoder.decode(sock.recv()), WarmupPlan):
        pass                                            # heartbeats
    received[rank] = message
    sock.send(encode(WorkerReady(rank=rank, num_kv_blocks=64, max_model_len=max_model_len,
                                 vocab_size=128, eos_token_ids=[2], device="cuda:0")))
    sock.close(linger=1000)


def test_every_rank_warms_up_the_buckets_the_scheduler_derived_once(tmp_path,
                                                                    monkeypatch) -> None:
    # The scheduler's node's environment, folded into the config where it is made.
    environment = environment_options((), {"SPMD_DECODE_BS_BUCKET_MAX": "8"})
    config = EngineConfig(model="dummy:tiny-llama", nproc_per_node=2, execution_mode="bucketed",
                          max_num_seqs=16, max_num_batched_tokens=256,
                          worker_address=f"ipc://{tmp_path}/workers", **environment)
    server = SimpleNamespace(config=config, warmup=None)
    ctx = zmq.Context()
    group = WorkerGroup(config, ctx, Encoder(), lambda: False)
    received: dict[int, WarmupPlan] = {}
    # The two ranks disagree on the context length (as two nodes with different model
    # files or options would): the first to load decides, for both.
    ranks = [threading.Thread(target=fake_rank, args=(ctx, config.worker_address, rank, length,
                                                      received))
             for rank, length in ((0, 512), (1, 1024))]
    for thread in ranks:
        thread.start()
    try:
        ready = group.gather_ready(lambda loaded: SchedulerServer._warmup_plan(server, loaded))
    finally:
        for thread in ranks:
            thread.join(10)
        group.close()
        ctx.term()
    assert sorted(ready) == [0, 1]
    assert received[0] == received[1] == server.warmup
    assert received[0].buckets in (engine_buckets(config, 512), engine_buckets(config, 1024))
    assert max(bs for bs, _ in received[0].buckets["decode"].buckets) == 8


def test_without_bucketing_the_plan_carries_no_buckets() -> None:
    server = SimpleNamespace(config=EngineConfig(model="dummy:tiny-llama", execution_mode="eager"),
                             warmup=None)
    loaded = WorkerLoaded(rank=0, max_model_len=512, device="cuda:0")
    assert SchedulerServer._warmup_plan(server, loaded) == WarmupPlan(buckets=None)


def test_a_cuda_rank_whose_attention_reads_context_lengths_gets_packed_prompts(
        monkeypatch) -> None:
    for name in [n for n in os.environ if "_BUCKET_" in n]:
        monkeypatch.delenv(name)
    config = EngineConfig(model="dummy:tiny-llama", execution_mode="compiled", max_num_seqs=32,
                          max_num_batched_tokens=512)
    kernel = derive_warmup_plan(config, WorkerLoaded(rank=0, max_model_len=1000,
                                                     device="cuda:0", context_from_tensors=True))
    assert kernel.buckets["prompt"].packed
    assert kernel.buckets["decode"].buckets == tuple((bs, 1024) for bs in (1, 2, 4, 8, 16, 24, 32))
    gathered = derive_warmup_plan(config, WorkerLoaded(rank=0, max_model_len=1000,
                                                       device="cuda:0"))
    assert len({s for _, s in gathered.buckets["decode"].buckets}) == 8     # 128 ... 1024
    # On CPU (no graphs) prompts stay in (batch, length) buckets.
    cpu = derive_warmup_plan(config, WorkerLoaded(rank=0, max_model_len=1000, device="cpu",
                                                  context_from_tensors=True))
    assert not cpu.buckets["prompt"].packed and cpu.buckets["prompt"].buckets
