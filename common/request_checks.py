"""Checks of a request's token ids that both the router (INVALID_ARGUMENT before anything is sent) and the
engine (any caller of add_request) run, with the same wording."""

from __future__ import annotations

from collections.abc import Sequence

from nanovllm.common.errors import RequestError


def check_prompt(
    token_ids: Sequence[int], max_model_len: int, vocab_size: int, generates: bool = True
) -> None:
    """`generates`: False for a pooling request (common/pooling.py), which may fill max_model_len."""
    n = len(token_ids)
    if n == 0:
        raise RequestError("the prompt has no tokens; it needs at least one")
    if not generates and n > max_model_len:
        raise RequestError(f"the input has {n} tokens but max_model_len is {max_model_len}")
    if generates and n >= max_model_len:
        raise RequestError(
            f"the prompt has {n} tokens but max_model_len is {max_model_len}: at most {max_model_len - 1} "
            f"leave room to generate"
        )
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"the prompt holds token id {bad}, outside the vocabulary [0, {vocab_size})")


def check_stop_token_ids(token_ids: Sequence[int], vocab_size: int, field: str = "stop_token_ids") -> None:
    """An id past the vocabulary would index past the logits row when banned (below min_tokens) and fail
    the whole batch's step, so it is refused with its request."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"{field} holds {bad}, outside the vocabulary [0, {vocab_size})")


def check_resumed_outputs(
    token_ids: Sequence[int], num_prompt_tokens: int, max_tokens: int, max_model_len: int, vocab_size: int
) -> None:
    """A request resumed with the tokens it already generated must still have one token to go."""
    n = len(token_ids)
    if n >= max_tokens:
        raise RequestError(
            f"output_token_ids holds {n} tokens: max_tokens {max_tokens} leaves none to generate"
        )
    if num_prompt_tokens + n >= max_model_len:
        raise RequestError(
            f"the prompt ({num_prompt_tokens} tokens) and output_token_ids ({n}) fill max_model_len "
            f"{max_model_len}: none is left to generate"
        )
    check_stop_token_ids(token_ids, vocab_size, field="output_token_ids")
