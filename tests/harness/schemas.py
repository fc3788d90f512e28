"""The JSON schema the structured-output tests and bench ask for: short valid outputs (bounded
strings and integers, an enum, a boolean), so a few dozen tokens always hold a whole object."""

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "admin"],
}
