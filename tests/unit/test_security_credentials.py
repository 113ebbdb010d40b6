"""The credential check of the internal plane and the public gRPC API: exactly one of the
configured secrets passes; a value that merely starts with (or is a prefix of, or extends)
a secret, another scheme, or another header is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stepahead import security

SECRET = "s3cret-token"


def _call(method: str, *metadata: tuple[str, str]):
    return SimpleNamespace(method=method, invocation_metadata=tuple(metadata))


@pytest.mark.parametrize("given, allowed", [
    (SECRET, True),
    (SECRET + "x", False),  # starts with the secret: a prefix match would take it
    (SECRET + SECRET, False),
    (SECRET[:-1], False),  # a prefix of the secret
    ("", False),
    ("x" + SECRET, False),
])
def test_the_cluster_token_must_equal_the_secret(given, allowed):
    check = security.cluster_interceptor(SECRET)
    assert check.permits(_call("/stepahead.v1.Scheduler/Connect", (security.CLUSTER_TOKEN_HEADER, given))) is allowed


@pytest.mark.parametrize("given, allowed", [
    ("Bearer " + SECRET, True),
    ("Bearer other", True),
    ("Bearer " + SECRET + "-and-more", False),
    ("Bearer other-and-more", False),
    ("Bearer " + SECRET[:3], False),
    ("bearer " + SECRET, False),
    (SECRET, False),
])
def test_an_api_key_must_equal_one_of_the_keys(given, allowed):
    check = security.api_key_interceptor([SECRET, "other"])
    assert check.permits(_call("/stepahead.v1.Generation/Generate", (security.API_KEY_HEADER, given))) is allowed


def test_no_header_and_another_header_are_refused_health_is_exempt():
    check = security.api_key_interceptor([SECRET])
    assert not check.permits(_call("/stepahead.v1.Generation/Generate"))
    assert not check.permits(_call("/stepahead.v1.Generation/Generate", ("x-other", "Bearer " + SECRET)))
    assert check.permits(_call(security.HEALTH_PREFIX + "Check"))
