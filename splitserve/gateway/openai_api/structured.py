"""The structured-output fields of the OpenAI API (and vLLM's) -> one ``StructuredOutput`` proto.

Accepted spellings, at most one constraint per request:

* OpenAI: ``response_format`` ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``;
* vLLM's older extras: ``guided_json`` (a schema, object or JSON text), ``guided_regex``,
  ``guided_choice``;
* vLLM's newer ``structured_outputs``: ``{"json": ...}``, ``{"regex": ...}``, ``{"choice": [...]}``,
  ``{"json_object": true}``.

Shapes are checked here (a 400 naming the field); whether the schema or regex is one the
grammar library can enforce is checked with every other sampling value, in the gRPC API's
validation (``splitserve.wire``). Grammars (``guided_grammar``, ``structured_outputs.grammar``)
are not supported and refused.
"""
from __future__ import annotations

import json
from typing import Any

from splitserve.common.errors import InvalidArgument
from splitserve.v1 import generation_pb2

_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "json_object")


def _schema_text(field: str, schema: Any) -> str:
    """A schema given as an object (or boolean) or as JSON text -> JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"{field} is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidArgument(f"{field} must be a JSON schema (an object), got {type(schema).__name__}")
    return json.dumps(schema)


def _regex(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{field} must be a non-empty string")
    return value


def _choice(field: str, value: Any) -> generation_pb2.StringList:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise InvalidArgument(f"{field} must be a non-empty list of non-empty strings")
    return generation_pb2.StringList(values=value)


def _from_response_format(value: Any) -> generation_pb2.StructuredOutput | None:
    if not isinstance(value, dict) or "type" not in value:
        raise InvalidArgument('response_format must be an object with a "type"')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return generation_pb2.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise InvalidArgument("response_format.json_schema.schema is required")
        schema = _schema_text("response_format.json_schema.schema", spec["schema"])
        return generation_pb2.StructuredOutput(json_schema=schema)
    raise InvalidArgument(f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}')


def _from_structured_outputs(value: Any) -> generation_pb2.StructuredOutput:
    if not isinstance(value, dict):
        raise InvalidArgument("structured_outputs must be an object")
    given = {k: v for k, v in value.items() if v not in (None, False)}
    other = sorted(set(given) - set(_STRUCTURED_OUTPUTS_KEYS))
    if other:
        raise InvalidArgument(f"structured_outputs.{other[0]}: not supported by this server")
    if len(given) != 1:
        raise InvalidArgument(f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_OUTPUTS_KEYS)}")
    (key, v), = given.items()
    if key == "json":
        return generation_pb2.StructuredOutput(json_schema=_schema_text("structured_outputs.json", v))
    if key == "regex":
        return generation_pb2.StructuredOutput(regex=_regex("structured_outputs.regex", v))
    if key == "choice":
        return generation_pb2.StructuredOutput(choice=_choice("structured_outputs.choice", v))
    if v is not True:
        raise InvalidArgument("structured_outputs.json_object must be true when set")
    return generation_pb2.StructuredOutput(json_object=True)


def structured_output(body: dict[str, Any]) -> generation_pb2.StructuredOutput | None:
    """The one constraint the request's fields ask for (None for none); a 400 when several are set."""
    found: list[tuple[str, generation_pb2.StructuredOutput]] = []
    if body.get("response_format") is not None:
        spec = _from_response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    if body.get("guided_json") is not None:
        found.append(("guided_json", generation_pb2.StructuredOutput(
            json_schema=_schema_text("guided_json", body["guided_json"]))))
    if body.get("guided_regex") is not None:
        found.append(("guided_regex", generation_pb2.StructuredOutput(
            regex=_regex("guided_regex", body["guided_regex"]))))
    if body.get("guided_choice") is not None:
        found.append(("guided_choice", generation_pb2.StructuredOutput(
            choice=_choice("guided_choice", body["guided_choice"]))))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _from_structured_outputs(body["structured_outputs"])))
    if len(found) > 1:
        raise InvalidArgument(f"{found[1][0]}: only one structured-output constraint per request "
                              f"(also given: {found[0][0]})")
    return found[0][1] if found else None
