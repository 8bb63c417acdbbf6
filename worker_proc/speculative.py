"""Verification of speculative proposals from a deterministic drafter (n-gram prompt lookup, or
a draft model decoding greedily).

The drafter guesses k tokens p_1..p_k that may follow a request's text. The target model then
runs once over [last known token, p_1, ..., p_k] and yields k+1 rows of next-token logits: row i
is what the model predicts after the input at position i, so row i judges p_{i+1} and row k
predicts the token after the last guess. Verification walks the rows in order, keeps the guesses
the target agrees with, and ends with exactly one token of the target's own, so every step emits
between 1 and k+1 tokens and costs one forward pass.

Greedy requests (temperature 0) keep a guess when it equals the row's argmax; at the first
disagreement the argmax replaces the guess, and after k agreements row k's argmax is a free extra
token. The output is token for token what plain greedy decoding would give.

Sampled requests use rejection sampling, which leaves the distribution of the emitted text
exactly that of sampling the target one token at a time. With a draft distribution q and a target
distribution p for a position, the guess x is kept with probability min(1, p(x) / q(x)); when it
is not, a replacement is drawn from the residual max(0, p - q), renormalised. Our drafter has no
probabilities: it names one token, so q puts all its mass on x. Then q(x) = 1 and the acceptance
chance is simply p(x). In the residual, q only subtracts at x, where p(x) - 1 <= 0 is clipped to 0,
and elsewhere q is 0, so the residual is p with x's entry removed. Checking the claim: the token
emitted is x with probability p(x) (accepted), and y != x with probability
(1 - p(x)) * p(y) / (1 - p(x)) = p(y) (rejected, then y drawn), which is p itself.

p here is the same filtered distribution the ordinary sampler draws from (temperature, top-k,
min-p, top-p), renormalised because acceptance reads one probability directly: a guess that the
filters remove has p(x) = 0 and is always rejected. Randomness follows sampler.py: output j of
a seeded request draws everything (its uniform, then its correction or bonus token) from a
generator seeded with position_seed(seed, num_tokens + j), so results do not depend on batching
or on how many guesses were made before; unseeded requests share the runtime's generator.
"""
from __future__ import annotations

import torch
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.worker_proc.sampler import _filtered_probs, greedy_tokens, position_seed


def verify_proposals(logits: torch.Tensor, proposals: list[int], params: SamplingParams,
                     num_tokens: int, generator: torch.Generator) -> list[int]:
    """The tokens a request emits this step: the accepted prefix of `proposals`, then one token
    from the target (the correction at the first rejection, or the bonus after all k).

    logits: float32 [k+1, vocab] on any device, after penalties and token masks (what sample()
    would get), row i following the input [last known token, p_1, ..., p_k][i]. num_tokens: the
    request's length before this step, so output j is drawn as at length num_tokens + j.
    generator: the shared one, used when the request has no seed."""
    if not proposals or logits.shape[0] != len(proposals) + 1:
        raise ValueError(f"verify_proposals needs k >= 1 proposals and k+1 logit rows, got "
                         f"{len(proposals)} proposals and {logits.shape[0]} rows")
    if params.temperature == 0.0:
        return _verify_greedy(logits, proposals)
    return _verify_sampled(logits, proposals, params, num_tokens, generator)


def _verify_greedy(logits: torch.Tensor, proposals: list[int]) -> list[int]:
    """One argmax over all rows and one comparison on the device, then a single read back of
    the targets together with the number of leading agreements."""
    targets = greedy_tokens(logits)
    proposed = torch.tensor(proposals, dtype=targets.dtype, device=targets.device)
    # cumprod turns the agreement flags into 1 up to the first disagreement and 0 after it.
    accepted = (targets[:-1] == proposed).to(torch.int64).cumprod(0).sum()
    host = torch.cat([targets, accepted.view(1)]).tolist()
    count = host[-1]
    return proposals[:count] + [host[count]]


def _verify_sampled(logits: torch.Tensor, proposals: list[int], params: SamplingParams,
                    num_tokens: int, generator: torch.Generator) -> list[int]:
    """Rejection sampling with a one-hot draft: all k uniforms are drawn up front and compared
    on the device, so the host reads the accepted count once and the final token once."""
    k = len(proposals)
    probs = torch.stack([_filtered_probs(row, params) for row in logits])
    probs = probs / probs.sum(dim=-1, keepdim=True)     # top_p leaves the kept mass below 1
    generators = _output_generators(params, num_tokens, k + 1, logits.device, generator)
    if params.seed is None:
        uniforms = torch.rand(k, generator=generator, device=logits.device)
    else:
        uniforms = torch.cat([torch.rand(1, generator=g, device=logits.device)
                              for g in generators[:k]])
    proposed = torch.tensor(proposals, device=logits.device)
    accepted = uniforms < probs[torch.arange(k, device=logits.device), proposed]
    count = int(accepted.to(torch.int64).cumprod(0).sum())
    last = probs[count]
    if count < k:
        last = last.index_fill(0, proposed[count:count + 1], 0.0)   # residual: p without p_{count+1}
    final = torch.multinomial(last, 1, generator=generators[count])
    return proposals[:count] + [int(final)]


def _output_generators(params: SamplingParams, num_tokens: int, count: int,
                       device: torch.device, shared: torch.Generator) -> list[torch.Generator]:
    """The generator for each of `count` outputs: the shared one for an unseeded request, else
    one per output seeded by the length the sequence has when that output is drawn."""
    if params.seed is None:
        return [shared] * count
    generators = []
    for j in range(count):
        g = torch.Generator(device=device)
        g.manual_seed(position_seed(params.seed, num_tokens + j))
        generators.append(g)
    return generators
