"""Request line validation: both forms, and errors that name the line and the field."""

import json

import pytest

from jobs.schemas import MAX_PROMPT_CHARS, LineError, parse_line


def line(**record) -> str:
    return json.dumps(record)


def batch_line(url="/v1/completions", **body):
    return line(custom_id="req-1", method="POST", url=url, body=body)


def test_openai_completion_line():
    request = parse_line(batch_line(model="demo", prompt="Hello", max_tokens=7, temperature=0, stop="\n"), 3)
    assert request.custom_id == "req-1" and request.url == "/v1/completions"
    kwargs = request.parsed_body().sampling_kwargs()
    assert kwargs == {"max_tokens": 7, "temperature": 0.0, "stop": ["\n"]}


def test_openai_chat_line_with_content_parts_and_logprobs():
    request = parse_line(batch_line("/v1/chat/completions", model="demo", max_completion_tokens=9, logprobs=True,
                                    top_logprobs=3, messages=[
                                        {"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]), 1)
    body = request.parsed_body()
    assert body.template_messages() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert body.sampling_kwargs() == {"max_tokens": 9, "logprobs": 3}


def test_short_form_defaults_custom_id_to_line_number():
    request = parse_line(line(prompt="Summarize this", top_k=5, seed=3), 42)
    assert request.custom_id == "line-42" and request.url == "/v1/completions"
    assert request.parsed_body().sampling_kwargs() == {"top_k": 5, "seed": 3}
    assert parse_line(line(custom_id="doc-9", prompt="x"), 1).custom_id == "doc-9"


@pytest.mark.parametrize("raw_input, inputs", [
    ("one text", ["one text"]),
    (["a", "b"], ["a", "b"]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5], [6, 7]], [[5], [6, 7]]),
])
def test_embeddings_line_in_each_input_shape(raw_input, inputs):
    request = parse_line(batch_line("/v1/embeddings", model="m", input=raw_input, encoding_format="base64",
                                    dimensions=64, truncate_prompt_tokens=-1, user="u"), 2)
    body = request.parsed_body()
    assert request.url == "/v1/embeddings" and body.inputs() == inputs
    assert (body.encoding_format, body.dimensions, body.truncate_prompt_tokens) == ("base64", 64, -1)


@pytest.mark.parametrize("text, field, message", [
    ("not json", "line", "not valid JSON"),
    ("[1, 2]", "line", "must be a JSON object"),
    (line(prompt="x", bogus=1), "bogus", "Extra inputs"),
    (line(prompt=""), "prompt", "at least 1 character"),
    (line(prompt="x", temperature=3), "temperature", "less than or equal to 2"),
    (line(prompt="x", top_p=0), "top_p", "greater than 0"),
    (line(prompt="x", max_tokens=0), "max_tokens", "greater than or equal to 1"),
    (line(prompt="x", max_tokens="ten"), "max_tokens", "valid integer"),
    (line(prompt="x", stop=["a"] * 17), "stop", "at most 16"),
    (line(prompt="x", n=100), "n", "less than or equal to 16"),
    (line(prompt="x" * (MAX_PROMPT_CHARS + 1)), "prompt", "at most"),
    (line(custom_id="x" * 600, prompt="x"), "custom_id", "at most 512"),
    (line(custom_id="a", method="GET", url="/v1/completions", body={}), "method", "'POST'"),
    (line(custom_id="a", method="POST", url="/v1/moderations", body={}), "url", "/v1/embeddings"),
    (batch_line("/v1/embeddings"), "body.input", "Field required"),
    (batch_line("/v1/embeddings", input=[]), "body.input", "a list of token ids"),
    (batch_line("/v1/embeddings", input=["ok", ""]), "body.input", "non-empty string"),
    (batch_line("/v1/embeddings", input=[1, "a"]), "body.input", "or a list of such lists"),
    (batch_line("/v1/embeddings", input=[[1], [-2]]), "body.input", "integers >= 0"),
    (batch_line("/v1/embeddings", input=["x"] * 2049), "body.input", "at most 2048 inputs"),
    (batch_line("/v1/embeddings", input="x", encoding_format="hex"), "body.encoding_format", "'float' or 'base64'"),
    (batch_line("/v1/embeddings", input="x", dimensions=0), "body.dimensions", "greater than or equal to 1"),
    (batch_line("/v1/embeddings", input="x", truncate_prompt_tokens=-2), "body.truncate_prompt_tokens",
     "greater than or equal to -1"),
    (batch_line("/v1/embeddings", input="x", max_tokens=3), "body.max_tokens", "Extra inputs"),
    (batch_line(model="m"), "body.prompt", "Field required"),
    (batch_line("/v1/chat/completions", messages=[]), "body.messages", "at least 1"),
    (batch_line("/v1/chat/completions", messages=[{"role": "robot", "content": "x"}]), "body.messages.0",
     "role: must be system, developer, user, assistant or tool"),
    (batch_line("/v1/chat/completions", messages=[{"role": "tool", "content": "x"}]),
     "body.messages.0.tool_call_id", "Field required"),
    (batch_line("/v1/chat/completions", messages=[{"role": "user", "content": "x", "tool_calls": []}]),
     "body.messages.0.tool_calls", "Extra inputs are not permitted"),
    (batch_line("/v1/chat/completions", messages=[{"role": "user", "content": "x"}], tool_choice="required"),
     "body", "tool_choice: required needs tools"),
    (batch_line("/v1/responses", input=[{"type": "function_call", "name": "f"}]), "body.input.0.call_id",
     "Field required"),
    (batch_line("/v1/responses", input="x", previous_response_id="resp_1"), "body.previous_response_id",
     "does not store responses"),
    (batch_line(prompt="x", stream=True), "body.stream", "False"),
    (batch_line(prompt="x", presence_penalty=-3), "body.presence_penalty", "greater than or equal to -2"),
])
def test_invalid_lines_name_line_and_field(text, field, message):
    with pytest.raises(LineError) as caught:
        parse_line(text, 17)
    assert caught.value.line_number == 17
    assert caught.value.field == field
    assert message in caught.value.message


# -- every number a request carries is bounded ------------------------------------------------

def numeric_fields_without_bounds(schema: dict, definitions: dict, path: str = "", seen=None) -> list[str]:
    """Paths of integer and number nodes of a JSON schema that lack a lower or an upper bound."""
    seen = set() if seen is None else seen
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name in seen:
            return []
        return numeric_fields_without_bounds(definitions[name], definitions, path, seen | {name})
    found = []
    if schema.get("type") in ("integer", "number"):
        has_low = "minimum" in schema or "exclusiveMinimum" in schema
        has_high = "maximum" in schema or "exclusiveMaximum" in schema
        if not (has_low and has_high):
            found.append(path or "body")
    for key, child in schema.get("properties", {}).items():
        found += numeric_fields_without_bounds(child, definitions, f"{path}.{key}".lstrip("."), seen)
    for union in ("anyOf", "oneOf", "allOf"):
        for child in schema.get(union, []):
            found += numeric_fields_without_bounds(child, definitions, path, seen)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            found += numeric_fields_without_bounds(schema[key], definitions, f"{path}[]", seen)
    return found


def request_models():
    from jobs import schemas  # noqa: PLC0415
    from producers.routes.batches import CreateBatch  # noqa: PLC0415

    return [schemas.CompletionBody, schemas.ChatBody, schemas.EmbeddingBody, schemas.ShortLine,
            schemas.OnlineCompletionBody, schemas.OnlineChatBody, schemas.OnlineEmbeddingBody, CreateBatch]


@pytest.mark.parametrize("model", request_models(), ids=lambda m: m.__name__)
def test_every_number_of_every_request_schema_has_both_bounds(model):
    schema = model.model_json_schema()
    assert numeric_fields_without_bounds(schema, schema.get("$defs", {})) == []


HUGE = 2**64


@pytest.mark.parametrize("url, body, field", [
    ("/v1/completions", {"prompt": "a", "top_k": HUGE}, "body.top_k"),
    ("/v1/completions", {"prompt": "a", "seed": HUGE}, "body.seed"),
    ("/v1/completions", {"prompt": "a", "n": HUGE}, "body.n"),
    ("/v1/completions", {"prompt": "a", "logprobs": HUGE}, "body.logprobs"),
    ("/v1/completions", {"prompt": "a", "max_tokens": HUGE}, "body.max_tokens"),
    ("/v1/completions", {"prompt": "a", "min_tokens": HUGE}, "body.min_tokens"),
    ("/v1/completions", {"prompt": [1, HUGE]}, "body.prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": HUGE},
     "body.top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_k": -HUGE}, "body.top_k"),
    ("/v1/embeddings", {"input": [1, HUGE]}, "body.input"),
    ("/v1/embeddings", {"input": "a", "dimensions": HUGE}, "body.dimensions"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": HUGE}, "body.truncate_prompt_tokens"),
])
def test_a_number_past_what_the_engine_runs_is_refused_naming_its_field(url, body, field):
    line = json.dumps({"custom_id": "x", "method": "POST", "url": url, "body": body})
    with pytest.raises(LineError) as raised:
        parse_line(line, 7)
    assert raised.value.line_number == 7 and raised.value.field == field
