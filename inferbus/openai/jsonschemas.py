"""JSON Schemas that clients send (response formats, tool parameters), checked at the edge."""

from __future__ import annotations

from typing import Any

import jsonschema

from inferbus.openai.errors import OpenAIError


def check_json_schema(schema: dict[str, Any], param: str) -> None:
    """400 naming `param` and where the schema is wrong, if it is not valid JSON Schema."""
    check = jsonschema.validators.validator_for(schema).check_schema
    try:
        check(schema)
    except jsonschema.SchemaError as invalid:
        where = "/".join(str(p) for p in invalid.path)
        raise OpenAIError(400, f"Invalid schema for {param}" + (f" at `{where}`" if where else "")
                          + f": {invalid.message}", param=param, code="invalid_value") from None
