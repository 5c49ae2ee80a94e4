"""Output constraints (structured outputs) in request bodies, checked at the boundary.

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}) and vLLM's
`structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}).
A JSON schema must be a valid schema and use only features the workers' grammar
compiler enforces (grammar_support/json_schema.py); a regex must compile. EBNF grammars
are checked by the compiler on the worker: a bad one becomes that request's error line.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    field_validator,
    model_validator,
)

from grammar_support.json_schema import unsupported_features

MAX_CONSTRAINT_CHARS = 100_000
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays; a property of a property is two levels
MAX_SCHEMA_NODES = 10_000  # objects, arrays and values


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def check_schema_size(schema: Any) -> Any:
    """Bounds that keep every later check (and the grammar compiler) from recursing without end,
    or from compiling megabytes of text: measured without recursion, before anything walks the
    schema. Its text (keys and strings) has the bound of a regex or a grammar."""
    stack, num_nodes, num_chars = [(schema, 1)], 0, 0
    while stack:
        node, depth = stack.pop()
        num_nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if num_nodes > MAX_SCHEMA_NODES:
            raise ValueError(f"the schema has more than {MAX_SCHEMA_NODES} nodes")
        num_chars += len(node) if isinstance(node, str) else sum(map(len, node)) if isinstance(node, dict) else 0
        if num_chars > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"the schema holds more than {MAX_CONSTRAINT_CHARS} characters of text")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return schema


def check_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON Schema that is itself valid (its metaschema) and uses only features the workers'
    compiler enforces; the compiler itself runs on the worker (it needs torch)."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path)
        raise ValueError(f"not a valid JSON Schema{f' at {where}' if where else ''}: {error.message}") from None
    problems = list(unsupported_features(schema))
    if problems:
        raise ValueError(f"not supported by the grammar compiler: {'; '.join(problems[:5])}"
                         + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))
    return schema


def check_regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"not a valid regex: {error}") from None
    return pattern


JsonSchema = Annotated[dict[str, Any], BeforeValidator(check_schema_size), AfterValidator(check_json_schema)]
Regex = Annotated[str, Field(min_length=1, max_length=MAX_CONSTRAINT_CHARS, json_schema_extra={"format": "regex"}),
                  AfterValidator(check_regex)]


class JsonSchemaFormat(StrictModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: Annotated[str, Field(max_length=MAX_CONSTRAINT_CHARS)] | None = None
    schema_: JsonSchema = Field(alias="schema")
    strict: StrictBool | None = None


class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


# OpenAI's response_format, one model per type, so the OpenAPI schema says which fields go with which.
ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class _OneConstraint(StrictModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def as_params(self) -> dict[str, Any]:
        """engine.StructuredOutputsParams' fields."""
        return self.model_dump(by_alias=True)


class JsonConstraint(_OneConstraint):
    json_: JsonSchema = Field(alias="json")


class RegexConstraint(_OneConstraint):
    regex: Regex


class ChoiceConstraint(_OneConstraint):
    choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(min_length=1, max_length=256)]


class GrammarConstraint(_OneConstraint):
    grammar: Annotated[str, Field(min_length=1, max_length=MAX_CONSTRAINT_CHARS)]


class JsonObjectConstraint(_OneConstraint):
    json_object: Literal[True]


# vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object.

CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
def _constraint_key(value) -> str | None:
    if isinstance(value, dict):
        return next(iter(value), None)
    if isinstance(value, _OneConstraint):
        return next((key for key in CONSTRAINT_KEYS if key in value.as_params()), None)
    return None  # not an object: pydantic names the field


StructuredOutputsFields = Annotated[
    Annotated[JsonConstraint, Tag("json")] | Annotated[RegexConstraint, Tag("regex")]
    | Annotated[ChoiceConstraint, Tag("choice")] | Annotated[GrammarConstraint, Tag("grammar")]
    | Annotated[JsonObjectConstraint, Tag("json_object")],
    Discriminator(_constraint_key)]


class ConstraintFields(StrictModel):
    """The two constraint fields of a request body; at most one constraint per request."""

    response_format: ResponseFormat | None = None  # OpenAI's
    structured_outputs: StructuredOutputsFields | None = None  # vLLM's extension

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _check_structured_outputs(cls, value):
        """One message for the rule the union states (each member's errors would be noise)."""
        if value is not None and not isinstance(value, (dict, _OneConstraint)):
            raise ValueError(f"must be an object with exactly one of {', '.join(CONSTRAINT_KEYS)}")
        if isinstance(value, dict) and len(value) != 1:
            raise ValueError(f"give exactly one of {', '.join(CONSTRAINT_KEYS)}, got {sorted(value) or 'none'}")
        if isinstance(value, dict) and next(iter(value)) not in CONSTRAINT_KEYS:
            raise ValueError(f"unknown constraint {next(iter(value))!r}; one of {', '.join(CONSTRAINT_KEYS)}")
        return value

    @field_validator("response_format", mode="before")
    @classmethod
    def _check_response_format(cls, value):
        if isinstance(value, dict) and value.get("type") == "json_schema" and "json_schema" not in value:
            raise ValueError("json_schema: required with type json_schema")
        return value

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("response_format, structured_outputs: give one constraint, not both")
        return self

    def constraint(self) -> dict[str, Any] | None:
        """The output constraint as engine.StructuredOutputsParams' fields, or None."""
        if self.structured_outputs is not None:
            return self.structured_outputs.as_params()
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.type == "json_object":
            return {"json_object": True}
        return {"json": self.response_format.json_schema.schema_}
