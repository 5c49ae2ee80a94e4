"""Which JSON Schema features the workers' grammar compiler (xgrammar) enforces.

xgrammar turns a schema into a grammar and silently drops what it cannot express:
a schema with `not` or `uniqueItems` compiles, and the output then breaks the rule
the user wrote. So these features are refused up front, by name, at submit, in the
API and in `LLM.generate`, instead of surfacing as outputs that fail validation.

What is refused was measured against xgrammar 0.2.9, one witness each: a value
that jsonschema rejects and the compiled grammar still accepts
(tests/grammar_support/test_json_schema.py keeps every entry honest). Keywords outside
the JSON Schema vocabulary are annotations (the spec ignores them) and pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# keyword -> why it is refused (the grammar would accept values the keyword rules out)
IGNORED_KEYWORDS = {
    "not": "negation cannot be expressed as a grammar",
    "if": "conditional subschemas (if/then/else) are ignored",
    "then": "conditional subschemas (if/then/else) are ignored",
    "else": "conditional subschemas (if/then/else) are ignored",
    "dependentRequired": "dependencies between properties are ignored",
    "dependentSchemas": "dependencies between properties are ignored",
    "dependencies": "dependencies between properties are ignored",
    "contains": "contains/minContains/maxContains are ignored",
    "maxContains": "contains/minContains/maxContains are ignored",
}
# Formats the compiler turns into a pattern; any other format would be accepted as a plain string.
ENFORCED_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
    "uuid", "uri-template", "json-pointer", "relative-json-pointer"})
ANNOTATIONS = frozenset({"$schema", "$id", "$anchor", "$comment", "$defs", "definitions", "title", "description",
                         "default", "examples", "deprecated", "readOnly", "writeOnly", "discriminator"})

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
               "contains", "not", "if", "then", "else")


def unsupported_features(schema: Any, path: str = "") -> Iterator[str]:
    """Each feature the compiler would not enforce, as 'where: keyword: why' (where is a JSON pointer)."""
    if not isinstance(schema, dict):
        return
    where = path or "/"
    for keyword, why in IGNORED_KEYWORDS.items():
        if keyword in schema:
            yield f"{where}: {keyword}: {why}"
    if schema.get("uniqueItems") is True:
        yield f"{where}: uniqueItems: unique array items are not enforced"
    if "multipleOf" in schema and schema.get("type") != "integer":
        yield f"{where}: multipleOf: only enforced on integers (\"type\": \"integer\")"
    if "format" in schema and schema["format"] not in ENFORCED_FORMATS:
        yield (f"{where}: format: {schema['format']!r} is not enforced; enforced formats: "
               f"{', '.join(sorted(ENFORCED_FORMATS))}")
    if "$ref" in schema:
        if not str(schema["$ref"]).startswith("#"):
            yield f"{where}: $ref: only references inside the schema (#/...) resolve, not {schema['$ref']!r}"
        beside = sorted(set(schema) - ANNOTATIONS - {"$ref"})
        if beside:
            yield f"{where}: $ref: keywords beside a $ref are ignored ({', '.join(beside)}); move them into the target"
    all_of = schema.get("allOf")
    if all_of is not None and not (isinstance(all_of, list) and len(all_of) == 1 and set(all_of[0]) <= {"$ref"}
                                   and not (set(schema) - ANNOTATIONS - {"allOf"})):
        yield f"{where}: allOf: only a lone allOf of one $ref is enforced; merge the subschemas into one"
    one_of = schema.get("oneOf")
    if isinstance(one_of, list) and not _provably_disjoint(one_of):
        yield (f"{where}: oneOf: branches that may overlap would be enforced as anyOf; use anyOf, or give "
               f"each branch a distinct type or a required property with a distinct const")
    yield from _children(schema, path)


def _children(schema: dict, path: str) -> Iterator[str]:
    for keyword in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                yield from unsupported_features(sub, f"{path}/{keyword}/{_escape(name)}")
    for keyword in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            for index, sub in enumerate(schema[keyword]):
                yield from unsupported_features(sub, f"{path}/{keyword}/{index}")
    for keyword in _SUBSCHEMAS:
        if keyword not in IGNORED_KEYWORDS:  # an ignored keyword's own subschema is not looked into
            yield from unsupported_features(schema.get(keyword), f"{path}/{keyword}")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")  # JSON pointer escaping


def _provably_disjoint(branches: list) -> bool:
    """oneOf is exact only if no value can match two branches: each branch has its own JSON type,
    or all branches share a required property whose const/enum values differ (a discriminator)."""
    if not branches or not all(isinstance(branch, dict) for branch in branches):
        return False
    types = [branch.get("type") for branch in branches]
    if all(isinstance(kind, str) for kind in types):
        families = ["number" if kind == "integer" else kind for kind in types]
        if len(set(families)) == len(families):
            return True
    return any(_is_discriminator(key, branches) for key in _required(branches[0]))


def _required(branch: dict) -> list[str]:
    required = branch.get("required")
    return [key for key in required if isinstance(key, str)] if isinstance(required, list) else []


def _is_discriminator(key: str, branches: list[dict]) -> bool:
    seen: list[Any] = []
    for branch in branches:
        prop = (branch.get("properties") or {}).get(key)
        if key not in _required(branch) or not isinstance(prop, dict):
            return False
        values = [prop["const"]] if "const" in prop else prop.get("enum")
        if not isinstance(values, list) or any(value in seen for value in values):
            return False
        seen.extend(values)
    return True
