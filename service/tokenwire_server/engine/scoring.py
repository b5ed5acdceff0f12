"""Scoring a prompt (``OutputOptions.prompt_logprobs``), shared by the engines that run on torch.

Prompt token ``p + 1`` is scored by the logits the forward pass computes at position ``p``:
its log-probability given the tokens before it, under the model's own distribution (a
``log_softmax`` in fp32, before any sampling control), with the most likely alternatives
and the caller's ``logprobs_of`` where asked. The engines compute those logits only for the
rows and positions that asked (the batched engine's prompt chunks, one forward of the prompt
on the simple engine), and keep no full-vocabulary tensor past the step: what goes back to
the host is ``1 + 2 * top_n + len(named)`` numbers per position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..domain import Alternative, TokenInfo
from ..transfer import host_tensor


def score(logits: torch.Tensor, targets: Sequence[int], top_n: int, named: Sequence[int]) -> torch.Tensor:
    """``[positions, 1 + 2 * top_n + len(named)]`` float64 on the logits' device: per position (a
    row of ``logits``), the log-probability of its target token, then the ``top_n`` most likely
    ids and their log-probabilities, then the log-probabilities of ``named``."""
    device = logits.device
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    parts = [logprobs.gather(1, host_tensor(list(targets), torch.long, device).unsqueeze(1))]
    if top_n:
        values, ids = torch.topk(logprobs, top_n, dim=-1)
        parts += [ids.to(logprobs.dtype), values]
    if named:
        parts.append(logprobs.index_select(1, host_tensor(list(named), torch.long, device)))
    return torch.cat(parts, dim=1).to(torch.float64)


def token_infos(
    values: torch.Tensor | list[list[float]],
    targets: Sequence[int],
    top_n: int,
    named: Sequence[int],
    text: Callable[[int], str],
) -> list[TokenInfo]:
    """``score``'s rows (read to the host) as the scored tokens' ``TokenInfo``s."""
    lines = values.tolist() if isinstance(values, torch.Tensor) else values
    out = []
    for target, line in zip(targets, lines, strict=True):
        top = tuple(
            Alternative(int(t), text(int(t)), float(v))
            for t, v in zip(line[1 : 1 + top_n], line[1 + top_n : 1 + 2 * top_n], strict=True)
        )
        of = tuple(Alternative(t, text(t), float(v)) for t, v in zip(named, line[1 + 2 * top_n :], strict=True))
        out.append(TokenInfo(int(target), text(int(target)), float(line[0]), top, of))
    return out
