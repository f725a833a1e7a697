#!/usr/bin/env python3
"""Checks a JSON document (stdin) against the schema of one command (argv[2]: status, res_qp,
stat, ...) in tests/e2e/schema/vrdma.json (argv[1]).

The subset of JSON Schema the schemas use: $ref (#/definitions/NAME), type (a name or a list),
required, properties,
additionalProperties (false or a schema), items, enum, minimum, propertyNames.pattern. One rule
of vrdma's on top: every key is snake_case (^[a-z][a-z0-9_]*$) unless the object's schema gives
its own propertyNames (counters keyed by ibv_wc_status names). Prints every violation with its
path; exits 1 if there is one.
"""
import json
import re
import sys

TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}
SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")


def is_type(value, name):
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, TYPES[name])


def check(value, schema, path, errors):
    if "$ref" in schema:
        schema = DEFINITIONS[schema["$ref"].removeprefix("#/definitions/")]
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        if not any(is_type(value, t) for t in names):
            errors.append(f"{path}: {json.dumps(value)[:60]} is not {'/'.join(names)}")
            return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and is_type(value, "number") and value < schema["minimum"]:
        errors.append(f"{path}: {value} < {schema['minimum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: no {key!r}")
        pattern = re.compile(schema.get("propertyNames", {}).get("pattern", SNAKE.pattern))
        extra = schema.get("additionalProperties", True)
        for key, v in value.items():
            if not pattern.match(key):
                errors.append(f"{path}: key {key!r} does not match {pattern.pattern}")
            if key in props:
                check(v, props[key], f"{path}.{key}", errors)
            elif extra is False:
                errors.append(f"{path}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                check(v, extra, f"{path}.{key}", errors)
            else:
                check(v, {}, f"{path}.{key}", errors)  # its keys are snake_case too
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check(v, schema.get("items", {}), f"{path}[{i}]", errors)


DEFINITIONS = {}


def main():
    with open(sys.argv[1]) as f:
        whole = json.load(f)
    DEFINITIONS.update(whole["definitions"])
    schema = whole["commands"][sys.argv[2]]
    text = sys.stdin.read()
    try:
        doc = json.loads(text)
    except ValueError as e:
        print(f"not JSON ({e}): {text[:200]}")
        return 1
    errors = []
    check(doc, schema, "$", errors)
    for e in errors[:20]:
        print(e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
