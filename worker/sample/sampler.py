"""Turns a batch of next-token logits into chosen tokens (and optional logprobs).

Order of operations, per row: constraint mask -> banned ids -> penalties -> greedy
argmax, or temperature -> top-k -> top-p -> min-p -> sample. Logprobs describe the
model's raw distribution, so they are computed from the input logits, after only the
constraint mask (a constrained request's logprobs are those of its allowed tokens).

Sampling is by inversion: with u ~ U[0, 1), a row's token is the first, in vocabulary
order, at which the running sum of its filtered distribution passes u times its total.
One number per row, where a race of exponentials needed one per vocabulary entry (on a
CPU that draw cost 30x greedy's argmax). A seeded request's u for its n-th output token
is a hash of (seed, n) alone, so it gets the same tokens whatever shares the batch,
wherever its row is, and on whichever worker it resumes after a failover with its first
n tokens. On a CPU the C++ kernel (kernels/csrc/sampling_cpu.cpp) filters and draws
without sorting the vocabulary; elsewhere the torch path below computes the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import cast

import torch
import xxhash

from nanovllm.common.sampling_params import SamplingParams
from nanovllm.worker.device import host_tensor, to_device
from nanovllm.worker.sequence import TokenLogprobs
from nanovllm.worker.step import SamplerOutput, SamplingRow

__all__ = [
    "SampledBatch",
    "Sampler",
    "SamplingPlan",
    "apply_penalties",
    "filtered_probs",
    "position_seed",
    "position_uniform",
]

_NEG_INF = float("-inf")


class SampledBatch:
    """A step's picks as the device holds them, their copy to the host already queued.

    `token_ids` stays on the device, where the next step's inputs can take a pick before the host has seen
    it (overlapped scheduling); `result()` waits for the one copy of everything the host needs."""

    def __init__(
        self, token_ids: torch.Tensor, packed: torch.Tensor, unpack: Callable[[list], SamplerOutput]
    ):
        self.token_ids = token_ids
        self._unpack = unpack
        self._ready: torch.cuda.Event | None = None
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = packed

    def result(self) -> SamplerOutput:
        if self._ready is not None:
            self._ready.synchronize()
        return self._unpack(self._host.tolist())


# --------------------------------------------------------------------------- helpers


def position_seed(seed: int, position: int) -> int:
    """The seed of a request's draw for its output token number `position` (0-based): a hash of the two,
    so draws of neighbouring positions or seeds are unrelated."""
    return xxhash.xxh64_intdigest(seed.to_bytes(8, "little", signed=True) + position.to_bytes(8, "little"))


def position_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that a seeded request's output token number `position` is drawn with:
    the top 53 bits of position_seed, so every double of the form k / 2^53 is equally likely."""
    return (position_seed(seed, position) >> 11) * 2.0**-53


def _check_batch(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Reject malformed input up front, with a message that says what is wrong."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating point tensor, got {logits.dtype}")
    if logits.shape[0] != len(rows):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(rows)} SamplingRows were given")
    if logits.shape[1] == 0 and len(rows) > 0:
        raise ValueError("logits has an empty vocab dimension")


def _take(t: torch.Tensor, idx: list[int], batch: int) -> torch.Tensor:
    """Rows ``idx`` of ``t``; skips the gather (a copy) when every row is wanted."""
    if len(idx) == batch:
        return t
    return t[_index(idx, t.device)]


def _index(idx: list[int], device: torch.device) -> torch.Tensor:
    return to_device(host_tensor(idx), device)


def _padded(seqs: Sequence[Sequence[int]], pad: int, vocab: int, what: str) -> torch.Tensor:
    """[len(seqs), max_len] long tensor on CPU, right-padded with ``pad``; built with one torch call."""
    if any(len(s) and (min(s) < 0 or max(s) >= vocab) for s in seqs):
        raise ValueError(f"{what} contain token ids outside [0, {vocab})")
    width = max((len(s) for s in seqs), default=0)
    out = host_tensor([[*s, *([pad] * (width - len(s)))] for s in seqs])
    return out.reshape(len(seqs), width)


def _masked(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    kernels: ModuleType | None,
    idx: list[int] | None = None,
) -> torch.Tensor:
    """`logits`, or a float32 copy with the tokens each row's token_bitmask disallows at -inf (by the C++
    kernel on a CPU when given: unpacking the bits into a tensor costs as much as the rest of sampling).
    `idx`: the rows that have a mask, when the caller knows them."""
    if idx is None:
        idx = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
    if not idx:
        return logits
    batch, vocab = logits.shape
    # idx: the rows with a mask
    bits = to_device(torch.stack([cast(torch.Tensor, rows[i].token_bitmask) for i in idx]), logits.device)
    work = logits.to(torch.float32, copy=True)
    if kernels is not None and logits.device.type == "cpu":
        kernels.apply_token_bitmask_(work, bits, host_tensor(idx))
        return work
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    if len(idx) == batch:
        return work.masked_fill_(~allowed, _NEG_INF)
    index = _index(idx, logits.device)
    work[index] = work[index].masked_fill_(~allowed, _NEG_INF)
    return work


def _ban_(work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: set every banned (row, token) logit to -inf with one index_fill_ over the flat logits
    (an index_put with a scalar makes the host wait for the device; index_fill_ does not)."""
    vocab = work.shape[1]
    flat: list[int] = []
    for i, row in enumerate(rows):
        for t in row.banned_token_ids:
            if not 0 <= t < vocab:
                raise ValueError(f"banned token id {t} (row {i}) is outside [0, {vocab})")
            flat.append(i * vocab + t)
    if flat:
        work.view(-1).index_fill_(0, _index(flat, work.device), _NEG_INF)


def _penalize_(work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: repetition / presence / frequency penalties, only on the rows that set them."""
    batch, vocab = work.shape
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not idx:
        return
    params = [rows[i].params for i in idx]
    device = work.device
    sub = _take(work, idx, batch)
    n = len(idx)

    # Counts of each token in the output; padding goes to an extra column that is dropped.
    out_tok = to_device(
        _padded([rows[i].output_token_ids for i in idx], vocab, vocab, "output_token_ids"), device
    )
    counts = torch.zeros((n, vocab + 1), dtype=sub.dtype, device=device)
    counts.scatter_add_(1, out_tok, torch.ones(out_tok.shape, dtype=sub.dtype, device=device))
    counts = counts[:, :vocab]
    in_output = counts > 0

    coeffs = host_tensor(
        [
            [p.repetition_penalty for p in params],
            [p.presence_penalty for p in params],
            [p.frequency_penalty for p in params],
        ],
        torch.float32,
    )
    coeffs = to_device(coeffs, device)

    result = sub
    if any(p.repetition_penalty != 1.0 for p in params):
        # Repetition penalty looks at the prompt too (HF/vLLM semantics).
        prompt_tok = _padded([rows[i].prompt_token_ids for i in idx], vocab, vocab, "prompt_token_ids")
        seen = torch.zeros((n, vocab + 1), dtype=torch.bool, device=device)
        seen.scatter_(1, to_device(prompt_tok, device), True)
        seen = seen[:, :vocab] | in_output
        rep = coeffs[0].unsqueeze(1)
        # Dividing positive logits and multiplying negative ones both make the token less likely.
        shrunk = torch.where(result > 0, result / rep, result * rep)
        result = torch.where(seen, shrunk, result)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        result = result - coeffs[2].unsqueeze(1) * counts - coeffs[1].unsqueeze(1) * in_output.to(sub.dtype)

    if n == batch:
        work.copy_(result)
    else:
        work[_index(idx, device)] = result


def _needs_edit(rows: Sequence[SamplingRow]) -> bool:
    return any(r.banned_token_ids or r.params.has_penalties for r in rows)


def _prepared(logits: torch.Tensor, rows: Sequence[SamplingRow], needs_edit: bool) -> torch.Tensor:
    """float32 logits with bans and penalties applied (where `needs_edit`); never modifies the caller's
    tensor."""
    if not needs_edit:
        return logits.float()  # no copy when already float32: nothing below writes into it
    work = logits.to(torch.float32, copy=True)
    _ban_(work, rows)
    _penalize_(work, rows)
    return work


def _random_probs(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Final sampling distribution for non-greedy rows: temperature, then top-k, top-p, min-p.

    Each filter is applied to all rows at once with per-row parameter tensors; a
    filter that no row uses costs nothing.
    """
    vocab = x.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ps = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]  # inf: never cut
    # One host->device copy for all per-row parameters (vocab < 2**24, so k is exact in float32).
    spec = host_tensor([[p.temperature for p in params], ks, ps, [p.min_p for p in params]], torch.float32)
    spec = to_device(spec, x.device)
    x = x / spec[0].unsqueeze(1)

    use_k = any(k < vocab for k in ks)
    use_p = any(p < 1.0 for p in ps)
    if use_k or use_p:
        # Both filters are prefix cuts of the descending order. When every row has a top_k, only the
        # first max(k) positions can survive, so a partial topk replaces the (much dearer) full sort.
        width = max(ks)
        if width < vocab:
            sorted_x, order = x.topk(width, dim=-1, sorted=True)
        else:
            sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # stable: deterministic ties
        if use_k:
            positions = torch.arange(width, device=x.device).unsqueeze(0)
            sorted_x = sorted_x.masked_fill(positions >= spec[1].unsqueeze(1), _NEG_INF)
        if use_p:
            sorted_probs = sorted_x.softmax(dim=-1)
            # Keep a token while the mass strictly before it is still short of top_p: this is the
            # smallest prefix reaching top_p, and the top token (mass before it = 0) always stays.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_x = sorted_x.masked_fill(mass_before >= spec[2].unsqueeze(1), _NEG_INF)
        base = torch.full_like(x, _NEG_INF) if width < vocab else torch.empty_like(x)
        x = base.scatter_(1, order, sorted_x)
    if any(p.min_p > 0.0 for p in params):
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); log(0) = -inf leaves the row untouched.
        threshold = x.amax(dim=-1, keepdim=True) + spec[3].log().unsqueeze(1)
        x = x.masked_fill(x < threshold, _NEG_INF)
    return x.softmax(dim=-1)


# --------------------------------------------------------------------------- public API


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Logits after repetition/presence/frequency penalties (a new float32 tensor; input untouched)."""
    _check_batch(logits, rows)
    work = logits.to(torch.float32, copy=True)
    _penalize_(work, rows)
    return work


def filtered_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The [batch, vocab] distribution each row's next token is drawn from.

    Random rows get the constraint mask, bans, penalties, temperature and the top-k/top-p/min-p filters;
    greedy rows get a one-hot at their argmax. Mainly for tests and debugging.
    """
    _check_batch(logits, rows)
    work = _prepared(_masked(logits, rows, None), rows, _needs_edit(rows))
    batch = len(rows)
    probs = torch.zeros_like(work)
    greedy = [i for i, r in enumerate(rows) if r.params.temperature == 0.0]
    random = [i for i, r in enumerate(rows) if r.params.temperature != 0.0]
    if greedy:
        g = _index(greedy, work.device)
        probs[g, work[g].argmax(dim=-1)] = 1.0
    if random:
        r = _index(random, work.device)
        probs[r] = _random_probs(_take(work, random, batch), [rows[i].params for i in random])
    return probs


def greedy_tokens(logits: torch.Tensor, cpu_kernels: ModuleType | None) -> torch.Tensor:
    """Each row's argmax, as torch.argmax(dim=-1) picks it; on a CPU by the C++ kernel on the rows in float32
    (exact for 16-bit logits; PyTorch's CPU argmax walks a row in scalar steps:
    docs/performance.md#measurements-behind-choices-in-the-code)."""
    if cpu_kernels is not None and logits.device.type == "cpu":
        return cpu_kernels.argmax_rows(logits.float().contiguous())
    return logits.argmax(dim=-1)


@dataclass
class SamplingPlan:
    """What the sampler needs to know of a step's rows, read off them before the forward pass. After it,
    on a CPU, the rows and their SamplingParams have left the host's caches (the forward pass streams the
    KV cache through them) and each first read of one costs a miss; on a GPU the host reads them while the
    device computes. In the common step (sampled rows, no seeds, penalties, masks or logprobs) the sampler
    then touches no row at all."""

    rows: Sequence[SamplingRow]
    params: list[SamplingParams]
    masked: list[int]  # rows with a token_bitmask
    random: list[int]  # rows at temperature > 0, drawn; the others take the argmax
    wanted: list[int]  # rows that return logprobs
    needs_edit: bool  # some row has banned ids or penalties
    seeded: list[int]  # positions in `random` of the rows with a seed
    seeded_uniforms: list[float]  # their draws' numbers (position_uniform)
    # float64 [4, len(random)]: temperature, top_k, top_p and min_p of the random rows (the C++ kernel's).
    kernel_spec: torch.Tensor | None

    @property
    def argmax_only(self) -> bool:
        """Every row greedy with nothing to edit and no logprobs: an argmax is all."""
        return not self.random and not self.needs_edit and not self.wanted


class Sampler:
    """Chooses one token per logits row following each row's SamplingParams."""

    def __init__(self, generator: torch.Generator | None = None, cpu_kernels: ModuleType | None = None):
        # Engine-wide generator for rows without their own seed (None: torch's default RNG).
        self.generator = generator
        self.cpu_kernels = cpu_kernels  # the C++ kernels (masks, draws, argmax)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        return self.sample(logits, self.plan(rows)).result()

    def plan(self, rows: Sequence[SamplingRow]) -> SamplingPlan:
        """What `sample` needs of `rows` (see SamplingPlan); the rows must not change before it runs."""
        params = [r.params for r in rows]
        random = [i for i, p in enumerate(params) if p.temperature != 0.0]
        seeded = [j for j, i in enumerate(random) if params[i].seed is not None]
        kernel_spec = None
        if self.cpu_kernels is not None and random:
            picked = [params[i] for i in random]
            kernel_spec = host_tensor(
                [[p.temperature for p in picked], [p.top_k for p in picked], [p.top_p for p in picked]]
                + [[p.min_p for p in picked]],
                torch.float64,
            )
        return SamplingPlan(
            rows=rows,
            params=params,
            masked=[i for i, r in enumerate(rows) if r.token_bitmask is not None],
            random=random,
            wanted=[i for i, p in enumerate(params) if p.logprobs is not None],
            needs_edit=_needs_edit(rows),
            seeded=seeded,
            # A seeded row's number depends on its position: the output tokens before this one.
            seeded_uniforms=[
                position_uniform(cast(int, params[random[j]].seed), len(rows[random[j]].output_token_ids))
                for j in seeded
            ],
            kernel_spec=kernel_spec,
        )

    def sample(self, logits: torch.Tensor, plan: SamplingPlan) -> SampledBatch:
        """The picks of every row of `plan`, queued on the logits' device without waiting for it."""
        rows = plan.rows
        _check_batch(logits, rows)
        batch = len(rows)
        if batch == 0:
            empty = torch.empty(0, dtype=torch.long, device=logits.device)
            return SampledBatch(empty, empty, lambda ids: SamplerOutput([], []))
        logits = _masked(logits, rows, self.cpu_kernels, plan.masked)
        if plan.argmax_only:
            tokens = greedy_tokens(logits, self.cpu_kernels)
        else:
            tokens = self._choose(_prepared(logits, rows, plan.needs_edit), plan)
        if not plan.wanted:
            return SampledBatch(tokens, tokens, lambda ids: SamplerOutput(ids, [None] * batch))
        return _with_logprobs(logits, plan.params, tokens, plan.wanted)

    def _choose(self, work: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
        """[batch] long tensor of chosen tokens: argmax for greedy rows, a draw for the others."""
        random, batch = plan.random, len(plan.rows)
        if not random:
            return greedy_tokens(work, self.cpu_kernels)
        sampled = self._draw(_take(work, random, batch), plan)
        if len(random) == batch:
            return sampled
        tokens = greedy_tokens(work, self.cpu_kernels)
        tokens[_index(random, work.device)] = sampled
        return tokens

    def _draw(self, x: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
        """One token per row of `x` (the plan's random rows), by inversion of its filtered distribution."""
        uniform = self._uniforms(plan, x.device)
        if plan.kernel_spec is not None and x.device.type == "cpu":
            assert self.cpu_kernels is not None  # a plan's kernel_spec is made for them
            return self.cpu_kernels.sample_rows(x.contiguous(), torch.cat([plan.kernel_spec, uniform[None]]))
        probs = _random_probs(x, [plan.params[i] for i in plan.random])
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        total = cdf[:, -1:]
        # The first token whose running sum passes u * total; keeping the target below the total keeps a
        # token of zero probability (past the last positive one, where the sum stops growing) out of reach.
        target = torch.minimum(uniform.unsqueeze(1) * total, total.nextafter(torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1)

    def _uniforms(self, plan: SamplingPlan, device: torch.device) -> torch.Tensor:
        """float64 [len(plan.random)] on `device`: the engine's generator for rows without a seed, and
        position_uniform for seeded rows."""
        uniform = torch.rand(len(plan.random), dtype=torch.float64, device=device, generator=self.generator)
        if plan.seeded:
            values = to_device(host_tensor(plan.seeded_uniforms, torch.float64), device)
            uniform[_index(plan.seeded, device)] = values
        return uniform


def _with_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], tokens: torch.Tensor, wanted: list[int]
) -> SampledBatch:
    """The chosen tokens, and for the rows in `wanted` their logprob and top-N from the raw logits: all of
    it packed into one tensor, so the step waits on the device once (float64 holds token ids exactly)."""
    batch = len(params)
    logp = _take(logits, wanted, batch).float().log_softmax(dim=-1)
    chosen = logp.gather(1, _take(tokens, wanted, batch).unsqueeze(1)).squeeze(1)
    top_n = min(max(params[i].logprobs or 0 for i in wanted), logp.shape[1])
    values, indices = logp.topk(top_n, dim=-1)
    parts = (tokens, chosen, values.flatten(), indices.flatten())
    packed = torch.cat([t.to(torch.float64) for t in parts])

    def unpack(host: list[float]) -> SamplerOutput:
        token_ids = [int(t) for t in host[:batch]]
        chosen_host = host[batch : batch + len(wanted)]
        top = host[batch + len(wanted) :]
        half = len(top) // 2
        out: list[TokenLogprobs | None] = [None] * batch
        for j, i in enumerate(wanted):
            n = params[i].logprobs or 0
            row_vals = top[j * top_n : j * top_n + n]
            row_ids = top[half + j * top_n : half + j * top_n + n]
            out[i] = TokenLogprobs(
                token_id=token_ids[i],
                logprob=chosen_host[j],
                # Tokens a constraint disallows (logprob -inf) are not among the most likely.
                top=[(int(t), v) for t, v in zip(row_ids, row_vals) if v != _NEG_INF],
            )
        return SamplerOutput(token_ids=token_ids, logprobs=out)

    return SampledBatch(tokens, packed, unpack)
