"""Log-probabilities of sampled and prompt tokens (SamplingParams.logprobs, prompt_logprobs):
computed on the device for the rows of the requests that ask, read back with the step's tokens.

They are of the raw model distribution, before penalties, temperature and top-k/top-p/min-p
filtering (what vLLM returns by default): the same for a token however it was picked.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from spmd_runtime.protocol.logprobs import StepLogprobs, TokenLogprobs


@dataclass
class LogprobRows:
    """Records for some requests, on the device until read: `counts[i]` consecutive rows for
    request_ids[i], each a chosen token and its logprob plus the top ks[i] (of a width-max(ks)
    top-k). prompt_starts: the prompt index of each request's first row; None for sampled rows."""

    request_ids: list[int]
    counts: list[int]
    ks: list[int]
    prompt_starts: list[int] | None
    chosen_ids: torch.Tensor
    chosen: torch.Tensor
    top_ids: torch.Tensor | None
    top: torch.Tensor | None
    # Rows of the tokens verified proposals emitted (StepLogprobs.verified), not one sample.
    verified: bool = False


def _log_softmax_top(logits: torch.Tensor, targets: torch.Tensor, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.view(-1, 1)).view(-1)
    if k == 0:
        return chosen, None, None
    top = logprobs.topk(k, dim=-1)
    return chosen, top.indices, top.values


def sampled_logprobs(logits: torch.Tensor, states: Sequence, request_ids: Sequence[int],
                     tokens: torch.Tensor) -> LogprobRows | None:
    """The sampled tokens' records for the rows (of logits, states and tokens) that ask."""
    rows = [row for row, state in enumerate(states) if state.params.logprobs is not None]
    if not rows:
        return None
    ks = [states[row].params.logprobs for row in rows]
    if len(rows) < len(states):
        index = torch.tensor(rows).to(logits.device, non_blocking=True)
        logits, tokens = logits.index_select(0, index), tokens.index_select(0, index)
    chosen, top_ids, top = _log_softmax_top(logits, tokens, max(ks))
    return LogprobRows([request_ids[row] for row in rows], [1] * len(rows), ks, None, tokens,
                       chosen, top_ids, top)


def verified_logprobs(logits: torch.Tensor, runs: Sequence[tuple[int, int, int, list[int]]]
                      ) -> LogprobRows | None:
    """Records of the tokens verifying requests emitted: runs of (request id, first row of
    `logits`, k, tokens), each token read at its row (the raw distribution, as sampled ones)."""
    if not runs:
        return None
    rows = [first + j for _, first, _, tokens in runs for j in range(len(tokens))]
    targets = torch.tensor([t for *_, tokens in runs for t in tokens]).to(logits.device)
    ks = [k for _, _, k, _ in runs]
    chosen, top_ids, top = _log_softmax_top(
        logits.index_select(0, torch.tensor(rows).to(logits.device)), targets, max(ks))
    return LogprobRows([rid for rid, *_ in runs], [len(tokens) for *_, tokens in runs], ks,
                       None, targets, chosen, top_ids, top, verified=True)


def prompt_logprobs(model, hidden: torch.Tensor, scheduled: Sequence[tuple[int, int]],
                    requests: Mapping, row_length: int | None) -> LogprobRows | None:
    """Records of the prompt tokens this step's positions predict, for the requests that ask:
    position p of a prompt gives token p + 1's. scheduled: (request id, tokens) in input order,
    each request's computed-token count not yet advanced; row_length: a prompt graph's layout
    (request i's tokens start at row i * row_length), None when tokens are packed."""
    hidden_rows: list[int] = []
    targets: list[int] = []
    request_ids, counts, ks, starts = [], [], [], []
    offset = 0
    for index, (request_id, num_tokens) in enumerate(scheduled):
        base = index * row_length if row_length else offset
        offset += num_tokens
        state = requests[request_id]
        if state.params.prompt_logprobs is None:
            continue
        num_prompt = state.num_prompt_tokens if state.num_prompt_tokens >= 0 else len(state.token_ids)
        start = state.num_computed_tokens
        stop = min(start + num_tokens, num_prompt - 1)
        if stop <= start:
            continue
        hidden_rows.extend(range(base, base + stop - start))
        targets.extend(state.token_ids[start + 1:stop + 1])
        request_ids.append(request_id)
        counts.append(stop - start)
        ks.append(state.params.prompt_logprobs)
        starts.append(start + 1)
    if not request_ids:
        return None
    device = hidden.device
    logits = model.compute_logits(hidden[torch.tensor(hidden_rows).to(device)])
    chosen_ids = torch.tensor(targets).to(device)
    chosen, top_ids, top = _log_softmax_top(logits, chosen_ids, max(ks))
    return LogprobRows(request_ids, counts, ks, starts, chosen_ids, chosen, top_ids, top)


def read_logprobs(groups: Sequence[LogprobRows | None]) -> list[StepLogprobs]:
    """The groups' records on the host, one StepLogprobs per request (after the step is done)."""
    records: dict[int, StepLogprobs] = {}
    for group in groups:
        if group is None:
            continue
        chosen_ids, chosen = group.chosen_ids.tolist(), group.chosen.tolist()
        top_ids = group.top_ids.tolist() if group.top_ids is not None else None
        top = group.top.tolist() if group.top is not None else None
        row = 0
        for i, (request_id, count, k) in enumerate(zip(group.request_ids, group.counts, group.ks,
                                                       strict=True)):
            entries = [TokenLogprobs([chosen_ids[r], *(top_ids[r][:k] if k else ())],
                                     [chosen[r], *(top[r][:k] if k else ())])
                       for r in range(row, row + count)]
            row += count
            record = records.setdefault(request_id, StepLogprobs(request_id))
            if group.verified:
                record.verified = entries
            elif group.prompt_starts is None:
                record.sampled = entries[0]
            else:
                record.prompt_start, record.prompt = group.prompt_starts[i], entries
    return list(records.values())
