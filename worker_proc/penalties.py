"""Repetition, presence and frequency penalties on a batch of logits, with tensor ops over all
penalized rows at once; a batch where no request asks for them is left untouched."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from spmd_runtime.protocol.sampling import SamplingParams


def penalize(logits: torch.Tensor, params: Sequence[SamplingParams],
             token_ids: Sequence[list[int]], num_prompt: Sequence[int],
             unread: Sequence[tuple[int, int] | None] = (),
             in_flight_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [rows, vocab]; token_ids: each row's prompt then output tokens, where a -1 at
    unread[row][0] is row unread[row][1] of in_flight_tokens (a step not read back yet);
    num_prompt: how many of them are the prompt (-1: all). Returns the penalized logits.

    repetition_penalty as transformers' RepetitionPenaltyLogitsProcessor, over prompt and
    output tokens: a positive logit is divided by it, a negative one multiplied. Then OpenAI's
    presence and frequency penalties, over output tokens: logit -= frequency * count +
    presence * (count > 0)."""
    rows = [row for row, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    vocab, device = logits.shape[-1], logits.device
    width = max(len(token_ids[row]) for row in rows)
    ids = torch.full((len(rows), width), -1, dtype=torch.int64)
    is_output = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        tokens = token_ids[row]
        ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        prompt = len(tokens) if num_prompt[row] < 0 else num_prompt[row]
        is_output[i, prompt:len(tokens)] = True
    ids, is_output = ids.to(device), is_output.to(device)
    late = [(i, unread[row]) for i, row in enumerate(rows)
            if row < len(unread) and unread[row] is not None]
    if late and in_flight_tokens is not None:
        at = torch.tensor([[i, index] for i, (index, _) in late]).to(device)
        source = torch.tensor([source_row for _, (_, source_row) in late]).to(device)
        ids[at[:, 0], at[:, 1]] = in_flight_tokens.index_select(0, source)
    # Padding (-1) counts in an extra column that is dropped.
    slot = torch.where(ids >= 0, ids, vocab)
    output = torch.zeros((len(rows), vocab + 1), dtype=logits.dtype, device=device)
    output.scatter_add_(1, slot, is_output.to(logits.dtype))
    seen = torch.zeros((len(rows), vocab + 1), dtype=torch.bool, device=device)
    seen.scatter_(1, slot, True)
    output, seen = output[:, :vocab], seen[:, :vocab]
    picked = [params[row] for row in rows]
    column = {"dtype": logits.dtype, "device": device}
    repetition = torch.tensor([[p.repetition_penalty] for p in picked], **column)
    presence = torch.tensor([[p.presence_penalty] for p in picked], **column)
    frequency = torch.tensor([[p.frequency_penalty] for p in picked], **column)
    index = torch.tensor(rows, device=device)
    chosen = logits.index_select(0, index)
    scaled = torch.where(chosen > 0, chosen / repetition, chosen * repetition)
    chosen = torch.where(seen, scaled, chosen)
    chosen = chosen - frequency * output - presence * (output > 0).to(logits.dtype)
    return logits.index_copy(0, index, chosen)


def penalize_requests(logits: torch.Tensor, states: Sequence, in_flight_tokens: torch.Tensor | None
                      ) -> torch.Tensor:
    """penalize() for worker request states (params, token_ids, num_prompt_tokens, unread)."""
    return penalize(logits, [s.params for s in states], [s.token_ids for s in states],
                    [s.num_prompt_tokens for s in states], [s.unread for s in states],
                    in_flight_tokens)
