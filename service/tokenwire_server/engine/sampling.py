"""Choosing the next token for every row of a batch at once, each row with its own parameters.

All rows are handled as tensors, in this order: the logit bias (-100 bans the token),
the repetition penalty (over the prompt and the tokens so far), the frequency and
presence penalties (over the tokens so far: OpenAI's), EOS and stop-token blocking
(min_new_tokens), the grammar mask of constrained rows (``structured``); greedy rows
take the exact argmax of that; sampled rows then take temperature, min_p, top_k, top_p
and the draw. Each of those is one indexed op over the step's rows. The log-probabilities
are the model's (before all of it), the picked token's and, where asked, the top
alternatives' and the caller's ``logprobs_of``; the results come back to the host in one
transfer per step.

Sampled rows draw with the Gumbel-max trick: ``argmax(logits / T + G)`` where the
noise ``G`` of each (row, token) comes from a counter-based hash of (seed, step,
token id), computed as tensor operations. The noise depends only on the request's
seed and how many tokens it has generated, never on which other rows share the
batch or where the row sits, so a seeded request gives the same tokens alone and
in any batch, and on either engine (both use this sampler).

Rows with top_k or top_p (limited rows) are drawn on the host from candidates: each
row's ``CANDIDATES`` (256) largest scaled values (a top k: ``RowOps.top``), put in the full
order's (value desc, token id asc), their probabilities taken from the whole row's
softmax (or the top_k largest values'), their noise hashed for those ids alone (bit
for bit ``gumbel_noise``'s). That replaces a stable sort of the whole vocabulary, a
softmax and cumsum over it and its noise (~44 ms a step at 16 rows, as long as the
forward pass) by a top-k and work on 256 columns.
Exact only where no kept token can lie past the candidates strictly above the
smallest one (no tie straddles the cut): checked per row on its own values (see the
NOTE in ``_limited_candidates``); a row that fails (a nucleus wider than 256, top_k
over 256, kept ties at the cut) takes a full sort of that row. The full sort computes
the same definition, so the path never changes a pick, and a row's path depends on its
own logits only. On a device (CUDA) every row takes the
full sort: choosing per row would read the device mid-launch.

Free rows (no top_k, top_p 1: a caller who sets only a temperature) hash the noise of the
tokens that can still win (``_free_near``): their best sum over the candidates is a floor,
and no token more than the largest noise (~16.6) below it can reach it. At temperature 1 on
real logits that is ~1/8 of the vocabulary, at 0.7 ~1/40; a row where most tokens are that
near hashes them all (what that saves: docs/benchmarks.md, "sampler-free-rows").
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..domain import Alternative
from ..structured import apply_constraints
from ..transfer import host_tensor
from .generation import Generation

NEG_INF = float("-inf")
# A logit bias at the contract's floor (SamplingParams.logit_bias: -100) bans its token.
BAN_BIAS = -100.0
_M32 = 0xFFFF_FFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so the
# int64 tensor arithmetic never overflows (torch has no unsigned 64-bit multiply).
_K1 = 0x7FEB_352D
_K2 = 0x5A6C_A68B
_K3 = 0x2C1B_3C6D


def mix32(x: int) -> int:
    """A 32-bit integer hash (xor-shift-multiply rounds); the scalar twin of ``_mix32``."""
    x &= _M32
    x ^= x >> 16
    x = (x * _K1) & _M32
    x ^= x >> 15
    x = (x * _K2) & _M32
    x ^= x >> 16
    x = (x * _K3) & _M32
    x ^= x >> 15
    return x


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """``mix32`` on an int64 tensor of values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _K1) & _M32
    x = x ^ (x >> 15)
    x = (x * _K2) & _M32
    x = x ^ (x >> 16)
    x = (x * _K3) & _M32
    return x ^ (x >> 15)


def row_keys(seed: int, step: int) -> tuple[int, int]:
    """Two 32-bit keys for one row's draw at ``step`` (tokens generated so far)."""
    seed &= 0xFFFF_FFFF_FFFF_FFFF
    base = mix32(mix32(seed >> 32) ^ (seed & _M32))
    first = mix32(base ^ mix32(step & _M32))
    second = mix32(first ^ 0x9E37_79B9)
    return first, second


def gumbel_noise(keys: torch.Tensor, vocab: int, ops: RowOps | None = None) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[rows, vocab]`` from per-row keys ``[rows, 2]`` (int64): a pure function of key and
    token id."""
    return noise_at(keys, torch.arange(vocab, dtype=torch.int64, device=keys.device).unsqueeze(0), ops)


def noise_at(keys: torch.Tensor, ids: torch.Tensor, ops: RowOps | None = None) -> torch.Tensor:
    """``gumbel_noise``'s values at token ``ids`` only (``[rows, n]`` int64, or ``[1, n]`` for every row): the
    same hash of the same (key, id), so bit for bit the same noise, at the cost of ``n`` tokens, not the vocabulary.
    ``ops``: the hash and its uniform number in one compiled pass (``noise_uniform``: the same bits) where it can."""
    if ops is not None and ops.library is not None and keys.device.type == "cpu":
        return _gumbel(ops.library.noise_uniform(keys.contiguous(), ids.contiguous()))
    h = _mix32(ids ^ keys[:, :1])
    h = _mix32(h ^ keys[:, 1:])
    return _gumbel_of(h >> 9)


def _gumbel_of(bits: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) from 23 uniform bits.

    NOTE: 23 bits, not 24: float32 holds every (b + 0.5) / 2**23 exactly, so ``uniform`` stays
    strictly inside (0, 1) and the noise finite. With 24 bits the top value rounded to 1.0,
    log(1) = 0 gave +inf noise (about one token in 16.7 million: a few per thousand steps
    at this vocabulary), and that token won the draw whatever its logit, even a masked one
    (-inf + inf = NaN, which argmax takes): a constrained row broke its format."""
    return _gumbel((bits.to(torch.float32) + 0.5) * (1.0 / (1 << 23)))


def _gumbel(uniform: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniform))


def _overflow_safe(rows: torch.Tensor) -> torch.Tensor:
    """A tiny temperature or repetition penalty overflows logits to +inf (and inf - inf to NaN).
    In a row with +inf, the overflowed tokens share the draw and the rest drop out; NaN drops out."""
    if rows.device.type == "cpu":
        # The rows as they are when none holds +inf or NaN (the max propagates NaN): the same
        # values the masks below give them, from one reduction instead of five passes over
        # [rows, vocab] (~1.7 ms a 16-row step). A host read: on a device the masks queue instead.
        top_value = rows.max()
        if not bool(torch.isnan(top_value) | torch.isposinf(top_value)):
            return rows
    top = torch.isposinf(rows)
    has_top = top.any(dim=-1, keepdim=True)
    cleaned = torch.where(torch.isnan(rows), NEG_INF, rows)
    only_top = torch.where(top, 0.0, NEG_INF)
    return torch.where(has_top, only_top, cleaned)


# A row's token, its log-probability, its top alternatives and its logprobs_of (where asked).
Pick = tuple[int, float | None, tuple[Alternative, ...], tuple[Alternative, ...]]


@dataclasses.dataclass(frozen=True)
class Drawn:
    """Picks launched on the device and not yet read: per row, the id, then (where asked) its
    log-probability, the top alternatives' ids and log-probabilities and the logprobs_of, as float64."""

    values: torch.Tensor
    seqs: Sequence[Generation]
    want_logprobs: list[bool]
    top_n: int
    named_n: int = 0  # columns of logprobs_of (the longest row's; shorter rows pad)


class RowOps:
    """The sampler's passes over a step's rows ``[rows, vocab]``: the compiled CPU ops' (``row_top``,
    ``row_argmax``, ``near``, ``noise_uniform``: engine/kernels, one pass each) where given and the rows are
    float32 on the CPU, else torch's (``topk``, ``argmax``, ``>=``, ``nonzero``, gathers and the int64 hash, each
    a pass or several over the step's rows: their cost, docs/benchmarks.md "sampler-free-rows"). The same
    results, but for which of the values tied at a top k's cut it keeps, and its order, which no caller here
    depends on."""

    def __init__(self, library: Any = None) -> None:
        self.library: Any = library if hasattr(library, "row_top") else None

    def _compiled(self, x: torch.Tensor) -> bool:
        return self.library is not None and x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()

    def top(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's ``k`` largest values and their ids (in no order; ties at the cut: any)."""
        if self._compiled(x):
            values, ids = self.library.row_top(x, k)
        else:
            values, ids = torch.topk(x, k, dim=-1)
        return values, ids

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first index of its largest value (torch.argmax's)."""
        picks: torch.Tensor = self.library.row_argmax(x) if self._compiled(x) else torch.argmax(x, dim=-1)
        return picks

    def near(
        self, x: torch.Tensor, keys: torch.Tensor, floors: torch.Tensor, most: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens where ``x >= floors`` (``[rows, 1]``), row-major: (their rows, ids, values, noise
        (``noise_at`` for ``keys``)), and each row's count of them; a row with more than ``most`` gives none."""
        if self._compiled(x):
            row, token, value, uniform, counts = self.library.near(
                x, keys.contiguous(), floors.squeeze(1).contiguous(), most
            )
            return row, token, value, _gumbel(uniform), counts
        mask = x >= floors
        counts = mask.sum(dim=-1)
        mask[counts > most] = False
        row, token = mask.nonzero(as_tuple=True)
        return row, token, x[row, token], noise_at(keys[row], token.unsqueeze(1)).squeeze(1), counts


TORCH_ROWS = RowOps()


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int], library: Any = None) -> None:
        """``library``: the compiled CPU ops (engine/kernels) for its passes over the rows (``RowOps``)."""
        self._eos = list(eos_token_ids)
        self._rows = RowOps(library)
        self.wait_s = 0.0  # the last call's device -> host copy (on CUDA: waiting for the step to finish)

    def __call__(self, logits: torch.Tensor, seqs: Sequence[Generation]) -> list[Pick]:
        """Pick one token per row of ``logits`` ([batch, vocab]) for ``seqs`` in the same order."""
        return self.collect(self.launch(logits, seqs))

    def launch(self, logits: torch.Tensor, seqs: Sequence[Generation]) -> Drawn:
        """The picks as tensor work on the logits' device, not yet read (on CUDA: queued behind
        the forward pass); ``collect`` reads them. Reads each row's state now (tokens so far,
        grammar), so a row's previous token must have been taken (``Generation.take``) first."""
        device = logits.device
        logits = logits.float()
        vocab = int(logits.shape[1])
        requests = [seq.request for seq in seqs]

        # The bias, the penalties and EOS blocking change the logits of some rows (a copy).
        processed = logits
        biased = [i for i, r in enumerate(requests) if r.sampling.logit_bias]
        penalised = [i for i, r in enumerate(requests) if r.sampling.repetition_penalty != 1.0]
        counted = [
            i for i, r in enumerate(requests) if r.sampling.frequency_penalty or r.sampling.presence_penalty
        ]  # fmt: skip
        # A constrained row's grammar decides when its answer ends: min_new_tokens does not block EOS there.
        # Before min_new_tokens, a row cannot draw EOS (unless it ignores EOS) nor its stop token ids.
        blocked: list[tuple[int, int]] = [
            (i, token)
            for i, (s, r) in enumerate(zip(seqs, requests, strict=True))
            if not s.eos_allowed and s.constraint is None
            for token in ({*r.stop_token_ids} | (set() if r.ignore_eos else set(self._eos)))
        ]
        constrained = [(i, s.constraint) for i, s in enumerate(seqs) if s.constraint is not None]
        if biased or penalised or counted or blocked or constrained:
            processed = logits.clone()
        if biased:
            self._bias(processed, [(i, requests[i].sampling.logit_bias) for i in biased])
        if penalised:
            row_index: list[int] = []
            col_index: list[int] = []
            factors: list[float] = []
            for i in penalised:
                seen = set(seqs[i].seen_ids())
                row_index += [i] * len(seen)
                col_index += seen
                factors += [requests[i].sampling.repetition_penalty] * len(seen)
            r_idx = host_tensor(row_index, torch.long, device)
            c_idx = host_tensor(col_index, torch.long, device)
            factor = host_tensor(factors, torch.float32, device)
            values = processed[r_idx, c_idx]
            processed[r_idx, c_idx] = torch.where(values > 0, values / factor, values * factor)
        if counted:
            self._penalise(processed, seqs, counted)
        if blocked:
            b_idx = host_tensor([i for i, _ in blocked], torch.long, device)
            e_idx = host_tensor([token for _, token in blocked], torch.long, device)
            processed[b_idx, e_idx] = NEG_INF
        if constrained:
            # Tokens that cannot continue a valid answer drop out before temperature, top_k and top_p.
            for i, error in apply_constraints(processed, constrained, vocab):
                seqs[i].grammar_failed(error)  # that row ends INTERNAL on this pick; the others go on

        sampled = [i for i, r in enumerate(requests) if not r.sampling.greedy]
        index = host_tensor(sampled, torch.long, device) if sampled else None  # _draw gathers the rows with it
        if index is not None and len(sampled) == len(requests):  # no greedy row: no argmax over the vocabulary
            chosen = self._draw(processed, sampled, index, seqs, vocab).to(device)
        else:
            chosen = self._rows.argmax(processed)  # greedy rows keep this, exactly
            if index is not None:
                chosen[index] = self._draw(processed, sampled, index, seqs, vocab)

        # Log-probabilities are of the model's distribution (before penalties and temperature).
        want_logprobs = [r.want_logprobs or r.top_logprobs > 0 or bool(r.logprobs_of) for r in requests]
        top_n = max((r.top_logprobs for r in requests), default=0)
        named_n = max((len(r.logprobs_of) for r in requests), default=0)
        parts = [chosen.to(torch.float64).unsqueeze(1)]
        if any(want_logprobs):
            logprobs = torch.log_softmax(logits, dim=-1)
            parts.append(logprobs.gather(1, chosen.unsqueeze(1)).to(torch.float64))
            if top_n:
                values, ids = torch.topk(logprobs, top_n, dim=-1)
                parts += [ids.to(torch.float64), values.to(torch.float64)]
            if named_n:  # each row's logprobs_of, padded with id 0 to the longest (read back to its own length)
                named = [list(r.logprobs_of) + [0] * (named_n - len(r.logprobs_of)) for r in requests]
                parts.append(logprobs.gather(1, host_tensor(named, torch.long, device)).to(torch.float64))
        return Drawn(torch.cat(parts, dim=1), seqs, want_logprobs, top_n, named_n)

    @staticmethod
    def _bias(processed: torch.Tensor, rows: list[tuple[int, tuple[tuple[int, float], ...]]]) -> None:
        """Add each row's logit bias, one indexed op for the step; BAN_BIAS sets the token to -inf."""
        _add_at(
            processed,
            [(i, token, NEG_INF if value <= BAN_BIAS else value) for i, pairs in rows for token, value in pairs],
        )

    @staticmethod
    def _penalise(processed: torch.Tensor, seqs: Sequence[Generation], rows: list[int]) -> None:
        """OpenAI's penalties over the tokens generated so far: a token's logit loses
        ``frequency_penalty`` times its count, and ``presence_penalty`` once if it came at all."""
        entries = []
        for i in rows:
            sampling = seqs[i].request.sampling
            frequency, presence = sampling.frequency_penalty, sampling.presence_penalty
            entries += [
                (i, token, -(frequency * count + presence)) for token, count in seqs[i].generated_counts().items()
            ]
        _add_at(processed, entries)

    def collect(self, drawn: Drawn) -> list[Pick]:
        """Read launched picks to the host: the step's one synchronisation with the device."""
        waited = time.perf_counter()
        host = drawn.values.tolist()  # the one device -> host transfer of the step
        self.wait_s = time.perf_counter() - waited
        seqs, want_logprobs, top_n = drawn.seqs, drawn.want_logprobs, drawn.top_n
        requests = [seq.request for seq in seqs]
        out: list[Pick] = []
        for i, line in enumerate(host):
            token = int(line[0])
            logprob: float | None = None
            top: tuple[Alternative, ...] = ()
            named: tuple[Alternative, ...] = ()
            if want_logprobs[i]:
                logprob = float(line[1])
                k = requests[i].top_logprobs
                if k:
                    ids_row, values_row = line[2 : 2 + top_n], line[2 + top_n : 2 + 2 * top_n]
                    top = tuple(
                        Alternative(int(t), seqs[i].token_text(int(t)), float(v))
                        for t, v in zip(ids_row[:k], values_row[:k], strict=True)
                    )
                asked = requests[i].logprobs_of
                if asked:
                    start = 2 + 2 * top_n
                    named = tuple(
                        Alternative(t, seqs[i].token_text(t), float(v))
                        for t, v in zip(asked, line[start : start + len(asked)], strict=True)
                    )
            out.append((token, logprob, top, named))
        return out

    def _draw(
        self, processed: torch.Tensor, sampled: list[int], index: torch.Tensor, seqs: Sequence[Generation], vocab: int
    ) -> torch.Tensor:
        """The sampled rows' picks; ``index``: ``sampled`` on the logits' device."""
        device = processed.device
        options = [seqs[i].request.sampling for i in sampled]
        temperature = host_tensor([o.temperature for o in options], torch.float32, device).unsqueeze(1)
        rows_of = processed if len(sampled) == processed.shape[0] else processed.index_select(0, index)
        scaled = _overflow_safe(rows_of / temperature)
        if any(o.min_p > 0 for o in options):
            scaled = _min_p(scaled, host_tensor([o.min_p for o in options], torch.float32, device).unsqueeze(1))
        keys = host_tensor([row_keys(seqs[i].seed, len(seqs[i].generated)) for i in sampled], torch.int64, device)
        limited = [0 < o.top_k < vocab or o.top_p < 1.0 for o in options]
        prefilter = device.type == "cpu" and vocab > CANDIDATES  # the candidate path (the module's docstring)
        if not any(limited):
            return _free_near(scaled, keys, vocab, self._rows) if prefilter else _free_full(scaled, keys, vocab)
        top_k = host_tensor([o.top_k if 0 < o.top_k < vocab else vocab for o in options], torch.long, device).unsqueeze(
            1
        )
        top_p = host_tensor([o.top_p for o in options], torch.float32, device).unsqueeze(1)
        limited_p = host_tensor([o.top_p < 1.0 for o in options], torch.bool, device).unsqueeze(1)
        if not prefilter:
            return _limited_full(scaled, keys, top_k, top_p, limited_p, vocab)
        # On the host: the rows split by kind with host indices (no device to queue behind).
        free = [i for i, lim in enumerate(limited) if not lim]
        if not free:  # every row limited: no copies of them
            return _limited_candidates(scaled, keys, top_k, top_p, limited_p, vocab, CANDIDATES, self._rows)
        picks = torch.empty(len(options), dtype=torch.long)
        rows = torch.tensor(free)
        picks[rows] = _free_near(scaled[rows], keys[rows], vocab, self._rows)
        rows = torch.tensor([i for i, lim in enumerate(limited) if lim])
        picks[rows] = _limited_candidates(
            scaled[rows], keys[rows], top_k[rows], top_p[rows], limited_p[rows], vocab, CANDIDATES, self._rows
        )
        return picks


# -- the draw: the definition (the full paths) and its exact shortcut (the candidate path) ---------------------
#
# A free row (no top_k, top_p 1) takes argmax over the vocabulary of scaled + G, the first such token by id.
# A limited row orders its tokens by (scaled value desc, token id asc); drops those past top_k; gives each token
# the probability softmax(scaled row) (no top_k) or softmax of the top_k largest values, as a row of the
# CANDIDATES largest (top_k <= CANDIDATES) or of the whole vocabulary (a larger top_k); drops a token once the
# mass before it (cumsum - probability, in that order) reaches top_p (the first token always stays); and takes
# the first token in that order with the largest kept scaled + G. The full paths compute exactly that, tensor
# operations only (no read on the host: they queue on a device); the candidate path computes it from the
# CANDIDATES largest values of each row and hands a row to the full sort where that might not be exact.

CANDIDATES = 256  # tokens kept per row by the prefilter (a constant: a row's path never depends on its neighbours)
# A row the first candidates cannot settle (a nucleus wider than them) tries this many before the full sort: a
# top-4096 of the default model's row takes ~0.25 ms, its full stable sort ~1.5 ms. Exact on the same test:
# the probabilities of a row without top_k come from its whole row, and cumsum's prefix is the full cumsum's.
WIDER = 4096
# The candidates' cumulated mass must clear top_p by this much to rule out every later token: room for
# float32 rounding in cumsum - probability (a few 1e-7), so a rounding never turns a dropped token back.
_MASS_MARGIN = 1e-5
# The largest noise ``_gumbel_of`` gives (its largest 23 bits), with room for rounding in ``scaled + G``
# (a few ulps of the sum): a token this far below a sum some token reaches cannot reach it.
_NOISE_SPAN = float(_gumbel_of(torch.tensor([(1 << 23) - 1]))) + 1e-2


def _add_at(processed: torch.Tensor, entries: list[tuple[int, int, float]]) -> None:
    """``processed[row, token] += amount`` for each entry, in one indexed op (no entry: nothing)."""
    if not entries:
        return
    device = processed.device
    rows, tokens, amounts = zip(*entries, strict=True)
    processed.index_put_(
        (host_tensor(list(rows), torch.long, device), host_tensor(list(tokens), torch.long, device)),
        host_tensor(list(amounts), torch.float32, device),
        accumulate=True,
    )


def _min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop the tokens less likely than ``min_p`` (``[rows, 1]``) times the row's most likely one:
    ``p >= min_p * p_max`` is ``scaled >= max + log(min_p)`` (a min_p of 0 keeps every token)."""
    best = scaled.max(dim=-1, keepdim=True).values
    return scaled.masked_fill(scaled < best + torch.log(min_p), NEG_INF)


def _free_full(scaled: torch.Tensor, keys: torch.Tensor, vocab: int, ops: RowOps = TORCH_ROWS) -> torch.Tensor:
    return ops.argmax(scaled + gumbel_noise(keys, vocab, ops))


def _free_near(scaled: torch.Tensor, keys: torch.Tensor, vocab: int, ops: RowOps = TORCH_ROWS) -> torch.Tensor:
    """``_free_full``'s picks from the tokens that can still win: a row's best ``scaled + G`` over its
    CANDIDATES largest values is a floor the winner reaches, and no token more than the largest noise
    below it can (``_NOISE_SPAN``). Their noise is hashed alone (``noise_at``: bit for bit), and each row
    takes the first token by id with the largest sum, as argmax does: the same pick from a fraction of
    the hashing (the module's docstring). A row where most tokens are that near (a flat row, a high
    temperature) takes the full path: the path never changes a pick."""
    rows = scaled.shape[0]
    values, ids = ops.top(scaled, min(CANDIDATES, vocab))
    best = (values + noise_at(keys, ids, ops)).amax(dim=-1, keepdim=True)
    row, token, value, noise, counts = ops.near(scaled, keys, best - _NOISE_SPAN, vocab // 4)  # rows' tokens by id
    wide = counts > vocab // 4
    picks = torch.empty(rows, dtype=torch.long)
    if bool(wide.any()):
        dense = torch.nonzero(wide).squeeze(1)
        picks[dense] = _free_full(scaled[dense], keys[dense], vocab, ops)
        if len(dense) == rows:
            return picks
    total = value + noise
    top = torch.full((rows,), NEG_INF).scatter_reduce(0, row, total, "amax")
    first = total == top[row]
    chosen = torch.full((rows,), vocab, dtype=torch.long).scatter_reduce(0, row[first], token[first], "amin")
    return torch.where(wide, picks, chosen)


def _probabilities(
    ordered: torch.Tensor, order: torch.Tensor, scaled: torch.Tensor, top_k: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k mask and the probabilities of ``ordered`` (``[rows, w]``, w >= CANDIDATES or the
    vocabulary: a row's first w values in order, ``order`` their ids) as the definition gives them."""
    width = ordered.shape[1]
    rank = torch.arange(width, device=ordered.device).unsqueeze(0)
    beyond_k = rank >= top_k
    masked = ordered.masked_fill(beyond_k, NEG_INF)
    free = torch.softmax(scaled, dim=-1).gather(1, order)  # rows without top_k: their whole row
    probs = torch.where(top_k >= vocab, free, torch.softmax(masked, dim=-1))  # top_k > CANDIDATES: all of it
    head = min(CANDIDATES, width)
    small_k = torch.softmax(masked[:, :head], dim=-1)  # top_k <= CANDIDATES: the first CANDIDATES
    probs = torch.cat([torch.where(top_k <= head, small_k, probs[:, :head]), probs[:, head:]], dim=1)
    return beyond_k, probs


def _kept(
    ordered: torch.Tensor,
    order: torch.Tensor,
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    limited_p: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ordered`` with the tokens top_k and top_p drop set to -inf, and the cumulated probabilities."""
    beyond_k, probs = _probabilities(ordered, order, scaled, top_k, vocab)
    mass = probs.cumsum(dim=-1)
    # Drop a token once the mass before it already reaches top_p (the first token always stays).
    first = torch.zeros_like(beyond_k)
    first[:, 0] = True
    dropped = beyond_k | (limited_p & (mass - probs >= top_p) & ~first)
    return ordered.masked_fill(dropped, NEG_INF), mass


def _limited_full(
    scaled: torch.Tensor,
    keys: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    limited_p: torch.Tensor,
    vocab: int,
) -> torch.Tensor:
    """The definition over the whole vocabulary (a full sort), for every row; free rows among them too."""
    noise = gumbel_noise(keys, vocab)
    ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    kept, _ = _kept(ordered, order, scaled, top_k, top_p, limited_p, vocab)
    picked = order.gather(1, torch.argmax(kept + noise.gather(1, order), dim=-1, keepdim=True)).squeeze(1)
    free = ((top_k >= vocab) & ~limited_p).squeeze(1)
    return torch.where(free, torch.argmax(scaled + noise, dim=-1), picked)


def _limited_candidates(
    scaled: torch.Tensor,
    keys: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    limited_p: torch.Tensor,
    vocab: int,
    width: int = CANDIDATES,
    ops: RowOps = TORCH_ROWS,
) -> torch.Tensor:
    """``_limited_full`` from each row's ``width`` largest values, exact where the kept tokens lie inside
    them; a row where they may not tries again from its ``WIDER`` largest, then takes the full path."""
    values, ids = ops.top(scaled, width)  # ties at the cut: any of them, in any order
    ids, by_id = ids.sort(dim=-1)
    ordered, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    order = ids.gather(1, by_value)  # (value desc, id asc), as the full stable sort orders them
    kept, mass = _kept(ordered, order, scaled, top_k, top_p, limited_p, vocab)
    picks = order.gather(1, torch.argmax(kept + noise_at(keys, order, ops), dim=-1, keepdim=True)).squeeze(1)
    # NOTE: exact when no kept token can lie past the candidates' first `inside`, those strictly above
    # the smallest candidate: they are the full order's first `inside` tokens, the same ids in the
    # same places with the same probabilities and cumulated mass, while the tokens after them (ties
    # of the smallest candidate, which the full order may rank otherwise, and the rest) are all dropped:
    # by top_k, or by top_p once the mass through `inside` clears it. Checked per row (its own values
    # only). Its cost: a full sort of each row that fails, one whose nucleus is wider than CANDIDATES
    # (a flat row, top_p near 1) or whose top_k is above it; measured on real default-model logits at
    # temperature 0.8, top_p 0.95, 16 rows: 0.125 rows a step (0.45 at 128, 0.075 at 512). A larger
    # CANDIDATES lifts it, at a wider top-k every step; so would a second, wider top-k for those rows.
    inside = (ordered > ordered[:, -1:]).sum(dim=-1, keepdim=True)
    through = mass.gather(1, (inside - 1).clamp(min=0))
    narrow_k = (top_k <= CANDIDATES) | (top_k >= vocab)  # top_k over CANDIDATES: probabilities need the rest
    exact = (inside > 0) & ((top_k <= inside) | (narrow_k & limited_p & (through >= top_p + _MASS_MARGIN)))

    def again(rows: torch.Tensor) -> torch.Tensor:
        if width < WIDER < vocab:  # the same test over more candidates: a top-k is ~6x cheaper than the sort
            return _limited_candidates(
                scaled[rows], keys[rows], top_k[rows], top_p[rows], limited_p[rows], vocab, WIDER, ops
            )
        return _limited_full(scaled[rows], keys[rows], top_k[rows], top_p[rows], limited_p[rows], vocab)

    return _mend(picks, exact, again)


def _mend(picks: torch.Tensor, exact: torch.Tensor, full: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``picks`` with the rows not ``exact`` (``[rows, 1]``) drawn again by ``full`` (given their indices)."""
    rows = torch.nonzero(~exact.squeeze(1)).squeeze(1)
    if len(rows):  # a host read: the candidate paths run on the host only
        picks[rows] = full(rows)
    return picks
