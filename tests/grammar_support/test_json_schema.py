"""The refused JSON Schema features are exactly ones the compiler would not enforce.

For each refused feature, a witness: a value that `jsonschema` rejects under the schema,
while xgrammar's grammar for it still accepts that value (and so would let the model
write it). For each feature kvfleet lets through, the grammar rejects its witness too.
If an xgrammar upgrade starts enforcing a refused feature, its test fails: then allow it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from pydantic import BaseModel, Field

from grammar_support.json_schema import IGNORED_KEYWORDS, unsupported_features

xgrammar = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string as grammar_accepts  # noqa: E402

SCHEMAS = json.loads((Path(__file__).resolve().parents[2] / "examples" / "extraction_schemas.json").read_text())
AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
INTS = {"type": "array", "items": {"type": "integer"}}
OPEN = {"type": "object", "additionalProperties": True}

# name: (schema, witness that breaks the schema)
REFUSED = {
    "not": ({"type": "string", "not": {"const": "a"}}, "a"),
    "if": ({**AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, {"a": 1}),
    "dependentRequired": ({**AB, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "dependentSchemas": ({**AB, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    "dependencies": ({**AB, "$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": ["b"]}},
                     {"a": 1}),
    "contains": ({**INTS, "contains": {"const": 1}}, [2]),
    "maxContains": ({**INTS, "contains": {"const": 1}, "maxContains": 1}, [1, 1]),
    "uniqueItems": ({**INTS, "uniqueItems": True}, [1, 1]),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, 0.3),
    "format": ({"type": "string", "format": "idn-hostname"}, "-"),
    "$ref": ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "minimum": 5}, 1),
    "allOf": ({"type": "integer", "allOf": [{"minimum": 3}]}, 1),
    "oneOf": ({"oneOf": [{"enum": ["a", "b"]}, {"enum": ["b", "c"]}]}, "b"),
}
# Features let through, with a witness the grammar must refuse.
ENFORCED = {
    "required": ({**AB, "required": ["a"]}, {}),
    "enum": ({"enum": ["a", "b"]}, "c"),
    "minimum": ({"type": "integer", "minimum": 2}, 1),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 2}, 2),
    "multipleOf on integers": ({"type": "integer", "multipleOf": 3}, 4),
    "minLength": ({"type": "string", "minLength": 2}, "a"),
    "pattern": ({"type": "string", "pattern": "^a+$"}, "b"),
    "format": ({"type": "string", "format": "date"}, "2020-13-01"),
    "minItems": ({**INTS, "minItems": 2}, [1]),
    "maxItems": ({**INTS, "maxItems": 1}, [1, 2]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}]}, ["a"]),
    "additionalProperties": ({**AB, "additionalProperties": {"type": "integer"}}, {"a": 1, "c": "x"}),
    "patternProperties": ({**OPEN, "patternProperties": {"^a": {"type": "integer"}}}, {"ab": "x"}),
    "propertyNames": ({**OPEN, "propertyNames": {"pattern": "^a"}}, {"b": 1}),
    "minProperties": ({**OPEN, "minProperties": 1}, {}),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "a"),
    "oneOf by type": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, True),
    "oneOf by discriminator": ({"oneOf": [
        {"type": "object", "properties": {"k": {"const": "a"}, "v": {"type": "integer"}}, "required": ["k", "v"]},
        {"type": "object", "properties": {"k": {"const": "b"}, "v": {"type": "string"}}, "required": ["k", "v"]},
    ]}, {"k": "a", "v": "x"}),
    "allOf of one $ref": ({"$defs": {"x": {"type": "integer"}}, "allOf": [{"$ref": "#/$defs/x"}]}, "a"),
}


def _grammar_accepts(schema, value) -> bool:
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return grammar_accepts(grammar, json.dumps(value))  # compact JSON, as constrained outputs are written


def _schema_accepts(schema, value) -> bool:
    validator = jsonschema.validators.validator_for(schema)  # the draft the schema names, else the newest
    return validator(schema, format_checker=jsonschema.FormatChecker()).is_valid(value)


@pytest.mark.parametrize("name", REFUSED)
def test_each_refused_feature_is_one_the_grammar_would_not_enforce(name):
    schema, witness = REFUSED[name]
    assert not _schema_accepts(schema, witness)
    assert _grammar_accepts(schema, witness), f"xgrammar now enforces {name}: stop refusing it"
    problems = list(unsupported_features(schema))
    assert any(f": {name}: " in problem for problem in problems), problems


@pytest.mark.parametrize("name", ENFORCED)
def test_each_feature_let_through_is_enforced_by_the_grammar(name):
    schema, witness = ENFORCED[name]
    assert not _schema_accepts(schema, witness)
    assert not _grammar_accepts(schema, witness)
    assert list(unsupported_features(schema)) == []


def test_every_ignored_keyword_has_a_witness():
    assert set(IGNORED_KEYWORDS) - {"then", "else"} <= set(REFUSED)


def test_problems_name_where_they_are():
    schema = {"type": "object", "properties": {"a/b": {"type": "array", "items": {"not": {"type": "null"}}}},
              "$defs": {"d": {"type": "string", "format": "regex"}}}
    assert [problem.split(":")[0] for problem in unsupported_features(schema)] == [
        "/properties/a~1b/items", "/$defs/d"]


def test_the_example_schemas_and_pydantic_models_pass():
    class Line(BaseModel):
        sku: str = Field(pattern=r"^[A-Z]{3}-\d{4}$")
        quantity: int = Field(ge=1, le=99)

    class Invoice(BaseModel):
        number: str
        total: float = Field(ge=0)
        currency: str = Field(json_schema_extra={"enum": ["EUR", "USD"]})
        lines: list[Line] = Field(min_length=1, max_length=5)
        note: str | None = None

    for schema in [*SCHEMAS.values(), Invoice.model_json_schema()]:
        assert list(unsupported_features(schema)) == [], schema
