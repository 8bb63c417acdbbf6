"""Operator control of the running batch (AdminBatchRequest): evict requests, cap the batch,
move the thermal target."""
from __future__ import annotations

import hmac
import logging

from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import AdminBatchReply, AdminBatchRequest, ErrorReply
from spmd_runtime.scheduler_proc.preemption import checked_victims
from spmd_runtime.scheduler_proc.scheduler import Scheduler
from spmd_runtime.scheduler_proc.thermal import select_victims

log = logging.getLogger("spmd.scheduler")


def admin_batch(config: EngineConfig, scheduler: Scheduler,
                message: AdminBatchRequest) -> AdminBatchReply | ErrorReply:
    """Apply the request (unless a dry run) and return the reply; an ErrorReply changes nothing."""
    if not config.enable_admin:
        return ErrorReply(tag=message.tag, code="disabled", message=(
            "admin calls are disabled on this server; start it with --enable-admin "
            "--admin-token SECRET (or --enable-admin alone on a trusted network)"))
    if config.admin_token and not hmac.compare_digest(
            message.token.encode(), config.admin_token.encode()):
        log.warning("refused an admin call with a %s token",
                    "missing" if not message.token else "wrong")
        return ErrorReply(tag=message.tag, code="forbidden", message=(
            "admin token missing or wrong: pass the server's --admin-token "
            "(Client(admin_token=...))"))
    error = admin_error(scheduler, message)
    if error is not None:
        return ErrorReply(tag=message.tag, message=error)
    previous = len(scheduler.running)
    num_evict = message.force_evict or 0
    if message.policy is None:
        victims = checked_victims(scheduler.thermal.policy, scheduler.running, num_evict)
    else:
        victims = select_victims(scheduler.running, num_evict, message.policy)
    new_running = previous - len(victims)
    new_max = message.max_num_seqs
    if new_max is None:
        new_max = min(scheduler.max_num_seqs, max(1, new_running)) if victims \
            else scheduler.max_num_seqs
    per_request = scheduler.thermal.watts_per_request(previous)
    reply = AdminBatchReply(
        tag=message.tag, previous_running=previous, new_running=new_running,
        evicted_request_ids=[r.request_id for r in victims], new_max_num_seqs=new_max,
        estimated_watts_saved=None if per_request is None else per_request * len(victims),
        dry_run=message.dry_run)
    if not message.dry_run:
        scheduler.evict(victims)
        scheduler.max_num_seqs = new_max
        if message.target_temp_c is not None:
            scheduler.thermal.policy.target_c = message.target_temp_c
        if victims:
            scheduler.thermal.admin_evictions += len(victims)
            scheduler.thermal.record(scheduler.counters.num_steps, "admin_evict", new_max,
                                     new_running, reply.evicted_request_ids)
        log.warning("admin batch control: evicted %s, max_num_seqs %d, thermal target "
                    "%.1f C", reply.evicted_request_ids, new_max,
                    scheduler.thermal.policy.target_c)
    return reply


def admin_error(scheduler: Scheduler, message: AdminBatchRequest) -> str | None:
    """What is wrong with the request's values, or None."""
    running = len(scheduler.running)
    if message.max_num_seqs is not None and message.max_num_seqs < 1:
        return f"max_num_seqs must be at least 1, got {message.max_num_seqs}"
    if message.force_evict is not None:
        if message.force_evict < 0:
            return f"force_evict must be >= 0, got {message.force_evict}"
        if message.force_evict > running:
            return (f"force_evict {message.force_evict} is more than the {running} running "
                    "requests; ask for at most that many")
    if message.target_temp_c is not None and not 20.0 <= message.target_temp_c <= 120.0:
        return f"target_temp_c must be between 20 and 120 (Celsius), got {message.target_temp_c}"
    return None
