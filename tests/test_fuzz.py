"""Hypothesis fuzzes the public API of a real router and worker while valid streams run beside it: no case
may end in INTERNAL, UNKNOWN or UNAVAILABLE, fail a bystander, or leave a KV block behind."""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings

from tests.fuzz import Bystanders, check, raw_messages, requests, run_raw, run_request
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
