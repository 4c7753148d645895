#!/usr/bin/env python3
"""Writes json_schema_fuzz's seed inputs into fuzz/schema_seeds/ (mode byte, schema or pattern, NUL, sample text; see
json_schema_fuzz.cpp). Regenerate: python3 fuzz/make_schema_seeds.py"""
import json, os

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schema_seeds")
os.makedirs(here, exist_ok=True)

def seed(mode, spec, text):
    return bytes([mode]) + (spec if isinstance(spec, str) else json.dumps(spec)).encode() + b"\0" + text.encode()

person = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
          "age": {"type": "integer", "minimum": 0, "maximum": 150}, "email": {"type": "string", "format": "email"},
          "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True}},
          "required": ["name", "age"]}
tree = {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "number", "multipleOf": 0.01},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}}, "required": ["v"]}},
        "$ref": "#/$defs/node"}
union = {"oneOf": [{"type": "object", "properties": {"kind": {"const": "x"}}, "required": ["kind"]},
                   {"type": "string", "pattern": "^[a-f0-9]{4,8}$"}],
         "allOf": [{"description": "d"}]}
tuple_ = {"type": "array", "prefixItems": [{"type": "integer", "exclusiveMinimum": -3}, {"format": "uuid"}],
          "items": False}
seeds = {
    "person": seed(0, person, '{"name": "Ann", "age": 30, "tags": ["a","c"]}'),
    "tree": seed(0, tree, '{"v":1.25,"kids":[{"v":0}]}'),
    "union": seed(3, union, '"00ff"'),
    "tuple": seed(0, tuple_, '[1, "123e4567-e89b-12d3-a456-426614174000"]'),
    "regex": seed(1, r"(\d{3}-)?[A-Za-z_]\w*(\.[a-z]+){0,3}|x+$", "555-abc.de"),
    "ebnf": seed(4, 'root ::= "[" ws (item ("," ws item)*)? "]"\nitem ::= [0-9]+ | "\\"" [a-z]* "\\""\nws ::= " "?',
                 '[1, "ab",22]'),
    "tool": seed(2, {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                 "n": {"type": "integer", "multipleOf": 3}}, "required": ["when"]},
                 "<tool_call>\n<function=f>\n<parameter=when>\n2024-01-02\n</parameter>\n</function>\n</tool_call>"),
}
for name, blob in seeds.items():
    with open(os.path.join(here, name), "wb") as f:
        f.write(blob)
