"""Hypothesis fuzzes the public API of a real router and worker while valid streams run beside it: no case
may end in INTERNAL, UNKNOWN or UNAVAILABLE (gRPC) or a 5xx (HTTP), fail a bystander, or leave a KV block
behind."""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz import (
    Bystanders,
    check,
    check_http,
    http_bodies,
    raw_messages,
    requests,
    run_http,
    run_raw,
    run_request,
)
from tests.services import wait_idle

CASES = 500
FUZZ_SETTINGS = settings(
    max_examples=CASES,
    deadline=None,
    database=None,  # no .hypothesis directory in the checkout
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


@pytest.mark.slow
def test_fuzzed_requests_fail_alone_and_cleanly(service) -> None:
    with (
        grpc.insecure_channel(service.router.address) as channel,
        Bystanders(service.router.address) as bystanders,
    ):

        @FUZZ_SETTINGS
        @given(request=requests())
        def case(request) -> None:
            check(run_request(channel, request))

        case()
    assert bystanders.failures == []
    assert bystanders.completed >= 3
    wait_idle(service.worker.address)


def test_fuzzed_bytes_get_invalid_argument_or_a_clean_stream(service) -> None:
    with grpc.insecure_channel(service.router.address) as channel:

        @settings(FUZZ_SETTINGS, max_examples=CASES // 5)
        @given(payload=raw_messages())
        def case(payload: bytes) -> None:
            check(run_raw(channel, payload))

        case()
    wait_idle(service.worker.address)


HTTP_CASES = 1_000


@pytest.mark.slow
def test_fuzzed_http_bodies_are_4xx_or_clean_answers(service) -> None:
    """1,000 hostile bodies on the OpenAI-compatible face: each a 4xx or a clean answer, never a 5xx; most
    of them are refused (the bodies are hostile), and the bystanders' streams are unchanged."""
    statuses: Counter[int] = Counter()
    with Bystanders(service.router.address) as bystanders:

        @settings(FUZZ_SETTINGS, max_examples=HTTP_CASES)
        @given(case=http_bodies())
        def case(case: tuple[str, bytes]) -> None:
            outcome = run_http(service.router.http_address, *case)
            statuses[outcome.status] += 1
            check_http(outcome)

        case()
    assert sum(statuses.values()) >= HTTP_CASES
    assert sum(n for status, n in statuses.items() if 400 <= status < 500) > HTTP_CASES // 2, statuses
    assert statuses[200] > 0, statuses  # and some were valid enough to be answered
    assert bystanders.failures == []
    assert bystanders.completed >= 3
    wait_idle(service.worker.address)
