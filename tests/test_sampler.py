"""Sampler tests: every option is checked against a plain Python/numpy reference."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from nanovllm.common.sampling_params import SamplingParams
from nanovllm.worker.sample.sampler import (
    Sampler,
    apply_penalties,
    filtered_probs,
    greedy_tokens,
    position_seed,
    position_uniform,
)
from nanovllm.worker.step import SamplingRow

VOCAB = 64


def make_row(params: SamplingParams, prompt=(), output=(), banned=()) -> SamplingRow:
    return SamplingRow(
        params=params,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        banned_token_ids=list(banned),
    )


def rand_logits(batch: int, vocab: int = VOCAB, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * scale


# --------------------------------------------------------------------------- references


def ref_penalties(x: np.ndarray, prompt, output, p: SamplingParams) -> np.ndarray:
    x = x.astype(np.float64).copy()
    for tok in range(len(x)):
        count = sum(1 for t in output if t == tok)
        if tok in prompt or count > 0:
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
        x[tok] -= p.frequency_penalty * count
        if count > 0:
            x[tok] -= p.presence_penalty
    return x


def ref_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


def ref_filtered(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """temperature -> top_k -> top_p -> min_p, written as loops over a small vocab."""
    x = np.asarray(x, dtype=np.float64) / p.temperature
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = order[: p.top_k] if p.top_k > 0 else order
    probs = ref_softmax(x[keep])
    kept_p = []
    mass = 0.0
    for tok, pr in zip(keep, probs):
        kept_p.append(tok)
        mass += pr
        if mass >= p.top_p:
            break
    probs = dict(zip(kept_p, ref_softmax(x[kept_p])))
    biggest = max(probs.values())
    final = {t: pr for t, pr in probs.items() if pr >= p.min_p * biggest}
    total = sum(final.values())
    out = np.zeros(len(x))
    for t, pr in final.items():
        out[t] = pr / total
    return out


# --------------------------------------------------------------------------- greedy and bans


def test_greedy_is_argmax_first_index_on_ties():
    logits = rand_logits(4)
    logits[2] = 0.0
    logits[2, 7] = logits[2, 30] = 5.0
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(4)]
    out = Sampler()(logits, rows)
    assert out.token_ids == [int(np.argmax(logits[i].numpy())) for i in range(4)]
    assert out.token_ids[2] == 7
    assert out.logprobs == [None] * 4


def test_the_cpu_kernels_argmax_is_torchs(kernels):
    """The greedy rows' C++ argmax (greedy_tokens) picks torch.argmax's index: the first of tied maxima, the first NaN where a
    row holds one, 0 for a row of -inf, at lengths around its vector widths and a real vocabulary's."""
    rows = []
    for vocab in (1, 7, 16, 63, 64, 65, 1000, 151_936):
        logits = rand_logits(6, vocab=vocab, seed=vocab)
        logits[1] = logits[1].round()  # ties everywhere
        logits[2, vocab // 2 :] = logits[2].max()  # the max tied from the middle on
        logits[3] = float("-inf")
        logits[4, vocab - 1] = float("nan")
        logits[5, vocab // 3] = float("inf")
        rows.append(logits)
        assert torch.equal(kernels.argmax_rows(logits), logits.argmax(dim=-1)), vocab
    greedy = [make_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    assert Sampler(cpu_kernels=kernels)(rows[-1], greedy).token_ids == rows[-1].argmax(dim=-1).tolist()
    with pytest.raises(RuntimeError, match="argmax_rows: logits must be contiguous float32"):
        kernels.argmax_rows(rows[-1].to(torch.bfloat16))
    # The proposers' 16-bit logits: widened exactly, the same pick (ties in bf16 included)
    bf16 = rows[-1].to(torch.bfloat16)
    assert torch.equal(greedy_tokens(bf16, kernels), bf16.argmax(dim=-1))


def test_banned_token_is_never_chosen():
    logits = rand_logits(2)
    top = [int(logits[i].argmax()) for i in range(2)]
    greedy = make_row(SamplingParams(temperature=0.0), banned=[top[0]])
    out = Sampler()(logits, [greedy, make_row(SamplingParams(temperature=0.0))])
    second = int(torch.topk(logits[0], 2).indices[1])
    assert out.token_ids == [second, top[1]]

    # Random rows: ban the three most likely tokens of a peaked distribution, draw many times.
    n = 2000
    row_logits = torch.zeros(VOCAB)
    banned = [3, 9, 40]
    row_logits[banned] = 10.0
    sampler = Sampler(torch.Generator().manual_seed(0))
    rows = [make_row(SamplingParams(temperature=1.0), banned=banned) for _ in range(n)]
    drawn = sampler(row_logits.expand(n, VOCAB).contiguous(), rows).token_ids
    assert not set(drawn) & set(banned)
    assert filtered_probs(row_logits.unsqueeze(0), rows[:1])[0, banned].sum() == 0


# --------------------------------------------------------------------------- penalties


PENALTY_CASES = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(presence_penalty=1.3),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(frequency_penalty=-0.5, presence_penalty=0.4, repetition_penalty=1.2),
    SamplingParams(),  # no penalties: row must come back unchanged
]


def test_penalties_match_reference():
    batch = len(PENALTY_CASES)
    logits = rand_logits(batch, seed=1)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, size=rng.integers(0, 12)).tolist() for _ in range(batch)]
    outputs = [rng.integers(0, VOCAB, size=rng.integers(0, 20)).tolist() for _ in range(batch)]
    outputs[3] = [5, 5, 5, 9]  # repeated tokens exercise the frequency count
    rows = [make_row(p, pr, o) for p, pr, o in zip(PENALTY_CASES, prompts, outputs)]
    before = logits.clone()
    got = apply_penalties(logits, rows)
    assert torch.equal(logits, before), "apply_penalties must not modify its input"
    for i, p in enumerate(PENALTY_CASES):
        want = ref_penalties(logits[i].numpy(), prompts[i], outputs[i], p)
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-6, atol=1e-5)
    assert torch.equal(got[-1], logits[-1])


def test_penalties_change_greedy_choice():
    base = torch.zeros(VOCAB)
    base[10], base[11], base[12] = 3.0, 2.5, 2.0
    sampler = Sampler()

    def pick(params: SamplingParams, prompt=(), output=()) -> int:
        return sampler(base.unsqueeze(0), [make_row(params, prompt, output)]).token_ids[0]

    assert pick(SamplingParams(temperature=0.0)) == 10
    # Repetition: a token from the prompt alone is penalised (3.0 / 1.5 = 2.0 < 2.5).
    assert pick(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[10]) == 11
    # Presence only counts the output, not the prompt.
    assert pick(SamplingParams(temperature=0.0, presence_penalty=1.0), prompt=[10]) == 10
    assert pick(SamplingParams(temperature=0.0, presence_penalty=1.0), output=[10, 10, 10]) == 11
    # Frequency scales with the count: one occurrence (3.0 - 0.4) keeps 10, two (2.2) do not.
    assert pick(SamplingParams(temperature=0.0, frequency_penalty=0.4), output=[10]) == 10
    assert pick(SamplingParams(temperature=0.0, frequency_penalty=0.4), output=[10, 10]) == 11


# --------------------------------------------------------------------------- temperature and filters


FILTER_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.8, top_k=1),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=VOCAB + 5),  # larger than vocab: no-op
]


# Every row has a top_k, so the sampler takes its partial-topk path instead of a full sort.
TOP_K_CASES = [
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.6),
    SamplingParams(temperature=1.2, top_k=20, min_p=0.1),
]


@pytest.mark.parametrize("cases", [FILTER_CASES, TOP_K_CASES], ids=["full_sort", "all_top_k"])
def test_filtered_probs_match_reference(cases: list[SamplingParams]):
    logits = rand_logits(len(cases), seed=2)
    rows = [make_row(p) for p in cases]
    got = filtered_probs(logits, rows)
    for i, p in enumerate(cases):
        want = ref_filtered(logits[i].numpy(), p)
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-4, atol=1e-6, err_msg=str(p))
        assert set(np.nonzero(got[i].numpy())[0]) == set(np.nonzero(want)[0]), str(p)


def test_filtered_probs_greedy_row_is_one_hot():
    logits = rand_logits(2, seed=3)
    rows = [make_row(SamplingParams(temperature=0.0)), make_row(SamplingParams(top_k=3))]
    got = filtered_probs(logits, rows)
    assert got[0].sum() == 1.0 and got[0, int(logits[0].argmax())] == 1.0
    assert int((got[1] > 0).sum()) == 3


def chi_square_p_value(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): 1 - P(df/2, statistic/2), the lower regularized gamma
    function by its power series (converges for every argument; df and statistic are small here)."""
    a, x = df / 2, statistic / 2
    if x <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > total * 1e-17:
        n += 1
        term *= x / (a + n)
        total += term
    lower = math.exp(a * math.log(x) - x - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def test_chi_square_p_value_matches_known_quantiles():
    # Tabulated upper quantiles of the chi-square distribution.
    assert chi_square_p_value(3.841, 1) == pytest.approx(0.05, abs=1e-4)
    assert chi_square_p_value(11.070, 5) == pytest.approx(0.05, abs=1e-4)
    assert chi_square_p_value(23.209, 10) == pytest.approx(0.01, abs=1e-4)


# A vocabulary past the C++ kernel's 512-entry blocks, its mass on tokens at and around block edges (the
# draw walks block sums, then one block) and the rest of it 12 nats down, where it still counts.
WIDE_VOCAB = 1300
WIDE_TOKENS = [0, 3, 200, 510, 511, 512, 513, 700, 1023, 1024, 1100, 1299]

DISTRIBUTION_CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "hot": SamplingParams(temperature=1.6),
    "top_k": SamplingParams(temperature=1.0, top_k=5),
    "top_p": SamplingParams(temperature=0.9, top_p=0.8),
    "min_p": SamplingParams(temperature=1.1, min_p=0.12),
    "all": SamplingParams(temperature=0.8, top_k=9, top_p=0.9, min_p=0.05),
}


def _distribution_logits(wide: bool) -> torch.Tensor:
    if not wide:
        return rand_logits(1, vocab=16, seed=4, scale=1.5)[0]
    logits = torch.full((WIDE_VOCAB,), -12.0)
    logits[WIDE_TOKENS] = rand_logits(1, vocab=len(WIDE_TOKENS), seed=9, scale=1.5)[0]
    return logits


@pytest.mark.parametrize("wide", [False, True], ids=["vocab16", "vocab1300"])
@pytest.mark.parametrize("seeded", [False, True], ids=["generator", "seeded"])
@pytest.mark.parametrize("path", ["torch", "cpu_kernel"])
@pytest.mark.parametrize("case", list(DISTRIBUTION_CASES))
def test_draws_follow_the_filtered_distribution(case: str, path: str, seeded: bool, wide: bool, request):
    """20,000 draws of one row against the reference distribution (the softmax of the processed logits), by
    Pearson's chi-square test. The draws are a fixed function of the seeds, so the test is deterministic; a
    correct sampler fails it for a one-in-a-million choice of seeds (p < 1e-6), while moving one percent of
    the probability to a neighbouring token adds about 20,000 * 0.01 = 200 to the statistic (p ~ 1e-35)."""
    params = DISTRIBUTION_CASES[case]
    n = 20_000
    logits = _distribution_logits(wide)
    vocab = logits.shape[0]
    want = ref_filtered(logits.numpy(), params)
    if seeded:  # each row its own request: u = position_uniform(seed, 0)
        rows = [make_row(dataclasses.replace(params, seed=1000 + i)) for i in range(n)]
    else:
        rows = [make_row(params) for _ in range(n)]
    kernels = request.getfixturevalue("kernels") if path == "cpu_kernel" else None
    sampler = Sampler(torch.Generator().manual_seed(123), kernels)
    drawn = np.bincount(sampler(logits.expand(n, vocab).contiguous(), rows).token_ids, minlength=vocab)
    support = want > 0
    assert drawn[~support].sum() == 0, f"drew tokens outside the support: {np.nonzero(drawn * ~support)[0]}"
    # Cells with an expected count below 5 (the chi-square approximation's rule) are pooled into one.
    expected = n * want
    big = support & (expected >= 5)
    observed_cells = [*drawn[big], drawn[support & ~big].sum()]
    expected_cells = [*expected[big], expected[support & ~big].sum()]
    if expected_cells[-1] < 5:
        observed_cells[-2] += observed_cells.pop()
        expected_cells[-2] += expected_cells.pop()
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed_cells, expected_cells))
    df = len(expected_cells) - 1
    if df == 0:  # one token carries everything: the support check above is the whole test
        return
    assert chi_square_p_value(statistic, df) > 1e-6, (statistic, df, observed_cells, expected_cells)


def test_the_cpu_kernel_and_the_torch_path_draw_the_same_tokens(kernels):
    """Both paths invert the same filtered distribution with the same uniform numbers (seeded rows), so
    they pick the same token unless a uniform falls within rounding (~1e-6 of the row's mass, the float32
    probabilities of the torch path) of a boundary between two tokens: about 1 row in 1,000 here."""
    batch, vocab = 2048, 1000
    logits = rand_logits(batch, vocab=vocab, seed=11, scale=3.0)
    settings = [
        {"temperature": 0.7},
        {"temperature": 1.0, "top_k": 40},
        {"temperature": 0.8, "top_p": 0.9},
        {"temperature": 1.2, "min_p": 0.05},
        {"temperature": 0.6, "top_k": 200, "top_p": 0.95, "min_p": 0.01},
    ]
    rows = [make_row(SamplingParams(**settings[i % len(settings)], seed=i)) for i in range(batch)]
    ours = Sampler(cpu_kernels=kernels)(logits, rows).token_ids
    theirs = Sampler()(logits, rows).token_ids
    support = filtered_probs(logits, rows) > 0
    assert all(support[i, t] for i, t in enumerate(ours)), "the kernel drew a token outside the support"
    differ = sum(a != b for a, b in zip(ours, theirs))
    assert differ <= batch // 100, f"{differ} of {batch} rows differ"


@pytest.mark.parametrize("path", ["torch", "cpu_kernel"])
def test_seeded_draws_depend_on_the_seed_and_position_alone(path: str, request):
    """A seeded row's n-th token inverts its distribution at position_uniform(seed, n), whatever came
    before: a fresh sampler given the first n tokens (a request resumed on another worker) draws the same."""
    kernels = request.getfixturevalue("kernels") if path == "cpu_kernel" else None
    logits = rand_logits(1, seed=5)
    params = SamplingParams(temperature=0.9, seed=7)
    cdf = np.cumsum(filtered_probs(logits, [make_row(params)])[0].double().numpy())
    sampler, out = Sampler(cpu_kernels=kernels), []
    for n in range(12):
        want = int(np.searchsorted(cdf, position_uniform(7, n) * cdf[-1], side="right"))
        assert sampler(logits, [make_row(params, output=out)]).token_ids[0] == want
        out.append(want)
    assert len(set(out)) > 3, "the test distribution should not be degenerate"
    for n in (0, 5, 11):
        resumed = Sampler(torch.Generator().manual_seed(n + 100), kernels)
        assert resumed(logits, [make_row(params, output=out[:n])]).token_ids == [out[n]]
    assert position_seed(7, 0) != position_seed(7, 1) != position_seed(8, 1)
    assert all(0.0 <= position_uniform(seed, n) < 1.0 for seed in range(50) for n in range(50))


# --------------------------------------------------------------------------- reproducibility


def _run_target(position: int | None, steps: int = 20) -> list[int]:
    """Sample `steps` tokens for one seeded request, alone or at `position` in a batch of 8."""
    target_params = SamplingParams(temperature=0.8, top_p=0.95, frequency_penalty=0.3, seed=1234)
    target_logits = rand_logits(1, seed=6)[0]
    others = [
        SamplingParams(temperature=1.0, seed=99),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_k=3, seed=5),
        SamplingParams(temperature=1.1, presence_penalty=0.5),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.0, min_p=0.1),
    ]
    other_out: list[list[int]] = [[] for _ in others]
    out: list[int] = []
    sampler = Sampler(torch.Generator().manual_seed(position or 0))
    noise = torch.Generator().manual_seed(42 + (position or 0))
    for _ in range(steps):
        target = make_row(target_params, prompt=[1, 2, 3], output=out)
        if position is None:
            rows, logits = [target], target_logits.unsqueeze(0)
        else:
            rows = [make_row(p, [4], o) for p, o in zip(others, other_out)]
            rows.insert(position, target)
            logits = torch.randn(8, VOCAB, generator=noise) * 2
            logits[position] = target_logits
        tokens = sampler(logits, rows).token_ids
        if position is None:
            out.append(tokens[0])
        else:
            out.append(tokens.pop(position))
            for seq, t in zip(other_out, tokens):
                seq.append(t)
    return out


def test_seeded_request_is_reproducible_across_batch_compositions():
    alone = _run_target(None)
    assert len(set(alone)) > 1, "the test distribution should not be degenerate"
    assert _run_target(0) == alone
    assert _run_target(5) == alone


# --------------------------------------------------------------------------- logprobs


def test_logprobs_come_from_raw_logits():
    logits = rand_logits(4, seed=8)
    params = [
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.5, repetition_penalty=2.0, logprobs=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=5),
    ]
    rows = [make_row(p, prompt=[1, 2], output=[int(logits[i].argmax())]) for i, p in enumerate(params)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp is not None
        ref = ref_log_softmax(logits[i].numpy())
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[lp.token_id], abs=1e-5)
        n = params[i].logprobs
        assert len(lp.top) == n
        want_ids = sorted(range(VOCAB), key=lambda t: -ref[t])[:n]
        assert [t for t, _ in lp.top] == want_ids
        for t, v in lp.top:
            assert v == pytest.approx(ref[t], abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))


# --------------------------------------------------------------------------- errors


def test_invalid_batches_raise_value_error():
    sampler = Sampler()
    row = make_row(SamplingParams())
    with pytest.raises(ValueError, match="rows"):
        sampler(rand_logits(3), [row, row])
    with pytest.raises(ValueError, match="2-D"):
        sampler(torch.zeros(VOCAB), [row])
    with pytest.raises(ValueError, match="floating"):
        sampler(torch.zeros(1, VOCAB, dtype=torch.long), [row])
    with pytest.raises(ValueError, match="banned"):
        sampler(rand_logits(1), [make_row(SamplingParams(), banned=[VOCAB])])
    with pytest.raises(ValueError, match="output_token_ids"):
        apply_penalties(rand_logits(1), [make_row(SamplingParams(presence_penalty=1.0), output=[VOCAB])])
    assert sampler(torch.zeros(0, VOCAB), []).token_ids == []


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("temperature", {"temperature": -1.0}),
        ("temperature", {"temperature": math.inf}),
        ("temperature", {"temperature": math.nan}),
        ("repetition_penalty", {"repetition_penalty": 1e-45}),
        ("repetition_penalty", {"repetition_penalty": math.inf}),
        ("min_p", {"min_p": math.nan}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("min_p", {"min_p": 2.0}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("presence_penalty", {"presence_penalty": 3.0}),
        ("max_tokens", {"max_tokens": 0}),
        ("min_tokens", {"max_tokens": 4, "min_tokens": 5}),
        ("logprobs", {"logprobs": 21}),
        ("stop_token_ids", {"stop_token_ids": [-1]}),
    ],
)
def test_sampling_params_validation(field: str, kwargs: dict):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-45, 0.001, 0.009])
def test_tiny_temperatures_are_raised_to_the_smallest_safe_divisor(temperature: float):
    """OpenAI's clients send 0.001 for "almost greedy": accepted as 0.01 (vLLM's rule), which keeps the
    overflow protection (1e-45, a denormal, made logits / it inf and the sampler pick token 0)."""
    params = SamplingParams(temperature=temperature, seed=3)
    assert params.temperature == SamplingParams.MIN_DIVISOR
    logits = rand_logits(1, scale=30.0)
    picked = Sampler()(logits, [make_row(params)]).token_ids
    assert picked == Sampler()(logits, [make_row(SamplingParams(temperature=0.01, seed=3))]).token_ids
    assert picked == [int(logits.argmax())]  # almost greedy, not the overflow's token 0
