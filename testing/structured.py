"""The JSON schema the structured-outputs tests and benchmark constrain outputs to."""

# Short keys keep outputs short (the test's cost is its decode steps). Strings are bounded
# by a pattern, not maxLength: xgrammar 0.2.8's maxLength rule admits raw control
# characters, which JSON forbids.
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        "k": {"enum": ["cat", "dog", "bird"]},
        "a": {"type": "integer", "minimum": 0, "maximum": 30},
        "w": {"type": "number", "minimum": 0.5, "maximum": 9.5},
        "o": {
            "type": "object",
            "properties": {"i": {"type": "integer", "minimum": 1, "maximum": 999}, "v": {"type": "boolean"}},
            "required": ["i", "v"],
            "additionalProperties": False,
        },
        "t": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["n", "k", "a", "w", "o", "t"],
    "additionalProperties": False,
}
