"""Choosing the next token for each sequence of a batch, each with its own parameters.

Greedy rows share one argmax; sampled rows each use their own seeded generator,
so a request's tokens depend on its seed, not on what else is in the batch. Both
engines use this, so the same request gives the same tokens on either engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..domain import Alternative
from .generation import Generation

NEG_INF = float("-inf")


def _overflow_safe(row: torch.Tensor) -> torch.Tensor:
    """A tiny temperature or repetition penalty overflows logits to +inf (and inf - inf to NaN),
    which softmax turns into NaN: then the overflowed tokens share the draw, the rest drop out."""
    top = torch.isposinf(row)
    if bool(top.any()):
        return torch.where(top, 0.0, NEG_INF)
    return torch.nan_to_num(row, nan=NEG_INF)


def _filter_top_k_top_p(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < row.shape[-1]:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p (the first token always stays).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        row = row.masked_fill(drop, NEG_INF)
    return row


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self._eos = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: Sequence[Generation]) -> list[tuple[int, float | None, tuple[Alternative, ...]]]:
        """Pick one token per row of ``logits`` ([batch, vocab]) for ``seqs`` in the same order."""
        logits = logits.float()
        want_logprobs = any(s.request.want_logprobs or s.request.top_logprobs for s in seqs)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        processed = logits
        copied = False
        for i, seq in enumerate(seqs):
            penalty = seq.request.sampling.repetition_penalty
            block_eos = not seq.eos_allowed and not seq.request.ignore_eos
            if penalty == 1.0 and not block_eos:
                continue
            if not copied:
                processed = logits.clone()
                copied = True
            if penalty != 1.0:
                ids = torch.tensor(sorted(set(seq.seen_ids())), device=logits.device, dtype=torch.long)
                values = processed[i, ids]
                processed[i, ids] = torch.where(values > 0, values / penalty, values * penalty)
            if block_eos:
                processed[i, self._eos] = NEG_INF

        picks = [0] * len(seqs)
        greedy_rows = [i for i, s in enumerate(seqs) if s.request.sampling.greedy]
        if greedy_rows:
            if len(greedy_rows) == len(seqs):
                chosen = torch.argmax(processed, dim=-1).tolist()
            else:
                chosen = torch.argmax(processed[greedy_rows], dim=-1).tolist()
            for row, token in zip(greedy_rows, chosen, strict=True):
                picks[row] = token
        for i, seq in enumerate(seqs):
            options = seq.request.sampling
            if options.greedy:
                continue
            scaled = _overflow_safe(processed[i] / options.temperature)
            filtered = _filter_top_k_top_p(scaled, options.top_k, options.top_p)
            probs = torch.softmax(filtered, dim=-1)
            picks[i] = int(torch.multinomial(probs, 1, generator=seq.generator).item())

        out: list[tuple[int, float | None, tuple[Alternative, ...]]] = []
        for i, (seq, token) in enumerate(zip(seqs, picks, strict=True)):
            logprob: float | None = None
            top: tuple[Alternative, ...] = ()
            if logprobs is not None and (seq.request.want_logprobs or seq.request.top_logprobs):
                logprob = float(logprobs[i, token])
                k = seq.request.top_logprobs
                if k:
                    values, ids = torch.topk(logprobs[i], k)
                    top = tuple(
                        Alternative(int(t), seq.token_text(int(t)), float(v))
                        for t, v in zip(ids.tolist(), values.tolist(), strict=True)
                    )
            out.append((token, logprob, top))
        return out
