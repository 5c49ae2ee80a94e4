"""Fuzzing: Schemathesis against the live API's own OpenAPI schema (every route, with
and without the bearer key), and Hypothesis on the line parser every request meets."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import positive_data_acceptance

from jobs.schemas import LineError, parse_line
from producers.api import create_app
from tests.services import ThreadedUvicorn

API_KEY = "fuzz-key"


@pytest.fixture(scope="module")
def live_api(redis_server):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVFLEET_API_KEY", API_KEY)
        with ThreadedUvicorn(create_app(redis_server.url)) as server:
            yield server


def semantic_exceptions(body) -> list:
    """Output constraints carry rules no OpenAPI schema can state: a JSON Schema must be valid
    against its own metaschema, a regex must compile, and one request takes one constraint;
    tools and Responses inputs have their own (CROSS_FIELD_RULES, responses_input_rules).
    Refusing such a body is right, so for those bodies only, "schema-valid data is accepted"
    is not checked (every other check still is)."""
    if isinstance(body, dict) and (set(body) & CROSS_FIELD_RULES or responses_input_rules(body)):
        return [positive_data_acceptance]
    return []


# Fields whose rules span fields: a constraint or text.format is a valid, supported JSON Schema;
# tool names are unique, a forced tool_choice names one of the tools (and its parameters
# compile as a grammar).
CROSS_FIELD_RULES = {"structured_outputs", "response_format", "text", "tools", "tool_choice"}


def responses_input_rules(body: dict) -> bool:
    """A Responses input of only reasoning items holds no message to answer."""
    items = body.get("input")
    return isinstance(items, list) and any(isinstance(i, dict) and i.get("type") == "reasoning" for i in items)


def test_every_route_answers_in_its_schema_and_never_5xx(live_api):
    """All of Schemathesis's checks on every operation the live schema lists: no 5xx, status
    codes, content types and bodies as documented, schema-invalid input refused, and auth
    enforced (it also sends each request without the key and with a wrong one)."""
    schema = schemathesis.openapi.from_url(f"{live_api.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    for operation in operations:
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def check(case):
            case.call_and_validate(headers={"Authorization": f"Bearer {API_KEY}"},
                                   excluded_checks=semantic_exceptions(case.body))

        check()


def test_every_schemathesis_phase_passes_coverage_included(live_api, tmp_path):
    """Schemathesis's own runner with every phase: examples, coverage (boundary and type-confusion
    values for each field, e.g. `"structured_outputs": [null, null]`), fuzzing and stateful.
    Every check runs but "schema-valid data is accepted", which constraint bodies may rightly
    fail (test above: there it is skipped for those bodies only)."""
    cli = Path(sys.executable).with_name("schemathesis")
    config = Path(__file__).with_name("schemathesis.toml")  # one check off for one operation: it says why
    done = subprocess.run([str(cli), "--config-file", str(config), "run", f"{live_api.url}/openapi.json", "--phases",
                           "examples,coverage,fuzzing,stateful", "-H", f"Authorization: Bearer {API_KEY}",
                           "--max-examples", "25",
                           "--no-color", "--report-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:]
    [(generated, passed)] = re.findall(r"(\d+) generated, (\d+) passed", done.stdout)
    assert int(generated) >= 500 and generated == passed, done.stdout[-2000:]
    assert re.search(r"Coverage \(in", done.stdout) and "Stateful" in done.stdout


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20)
FIELDS = ["custom_id", "method", "url", "body", "prompt", "messages", "model", "max_tokens", "temperature", "n",
          "stop", "logprobs", "top_logprobs", "seed", "stream", "role", "content", "input", "instructions", "tools",
          "tool_choice", "tool_calls", "tool_call_id", "chat_template_kwargs", "text", "type"]
LINE_LIKE = st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6)
BODY_LIKE = st.fixed_dictionaries({"custom_id": st.text(max_size=8), "method": st.just("POST"),
                                   "url": st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses", "/x"]),
                                   "body": LINE_LIKE})


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300) | LINE_LIKE.map(json.dumps).map(str.encode) | BODY_LIKE.map(json.dumps))
def test_parse_line_raises_nothing_but_line_error(raw):
    try:
        request = parse_line(raw, 7)
    except LineError as error:
        assert error.line_number == 7 and error.field and error.message
        return
    assert request.custom_id and request.url in ("/v1/completions", "/v1/chat/completions")
    request.parsed_body()  # what passed the parser validates again on the worker's side
