"""Schemathesis against /openapi.json with a fixed example budget: no server errors, every
response as the schema says (status code, content type, headers, body). Its own Redis and
API, no worker: the jobs it submits only queue, so the fuzzing neither runs nor slows the
other tests' jobs. Not checked: that every schema-valid body is accepted - cross-field
rules (exactly one of prompts/input_ids/messages, min_new_tokens <= max_new_tokens, the
configured limits) answer 422 by design."""
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_headers_conformance,
                                 response_schema_conformance, status_code_conformance)

from conftest import start_api
from cli.redis_server import EmbeddedRedis

EXAMPLES = 50  # per operation
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]


def test_api_conforms_to_its_schema(tmp_path):
    server = EmbeddedRedis()
    proc, url = start_api(server.url, tmp_path, "api-fuzz")
    try:
        schema = schemathesis.openapi.from_url(url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 6
        failures = {}
        for op in operations:
            @given(case=op.as_strategy())
            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case):
                case.call_and_validate(checks=CHECKS, timeout=10)
            try:
                fuzz()
            except Exception as e:  # noqa: BLE001 - collected, reported together below
                failures[op.label] = f"{type(e).__name__}: {e}"[:2000]
        assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
    finally:
        proc.stop()
        server.stop()
    with open(proc.log_path) as f:
        log = f.read()
    assert "Traceback" not in log, log[-3000:]
