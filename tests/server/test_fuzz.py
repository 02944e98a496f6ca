"""schemathesis fuzzes the served OpenAPI spec on the tiny model: no input may cause a 5xx.

Bounded: a few dozen valid and a few dozen invalid requests over all operations, generation
capped at a few tokens. (schemathesis' pytest plugin does not run under pytest 9, so the cases
come from its Hypothesis strategy with ``@given``.)
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from .conftest import KEYS

AUTH = {"Authorization": f"Bearer {next(iter(KEYS))}"}
MAX_TOKENS = 4
FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None
)


@pytest.fixture(scope="module")
def api_schema(tiny_server):
    return schemathesis.openapi.from_url(tiny_server.base_url + "/openapi.json")


def call(case) -> None:
    body = case.body
    if isinstance(body, dict):
        # keep generation short: the fuzzer is after the parser, not the model
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int) and body[name] > MAX_TOKENS:
                body[name] = MAX_TOKENS
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_TOKENS
    case.call_and_validate(headers=AUTH, checks=[not_a_server_error], timeout=30)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_causes_a_server_error(api_schema, tiny_server, mode):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= paths

    @FUZZ
    @given(case=api_schema.as_strategy(generation_mode=mode))
    def fuzz(case):
        call(case)

    fuzz()
    tiny_server.engine.call_sync(lambda e: e.check_integrity())
