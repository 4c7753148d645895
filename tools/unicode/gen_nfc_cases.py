#!/usr/bin/env python3
"""Generates tests/fixtures/tokenizer/nfc_cases.jsonl: NFC test cases whose expected output comes from
Python's unicodedata (an outside oracle for kiln's NFC code). Each line is [input, NFC(input)].
Regenerate from the repository root:
    python3 tools/unicode/gen_nfc_cases.py > tests/fixtures/tokenizer/nfc_cases.jsonl
"""
import json
import random
import unicodedata

rng = random.Random(20240601)
interesting = []
for cp in range(0x110000):
    if 0xD800 <= cp <= 0xDFFF:
        continue
    c = chr(cp)
    if unicodedata.decomposition(c) and not unicodedata.decomposition(c).startswith("<") or \
            unicodedata.combining(c) or unicodedata.normalize("NFC", c) != c:
        interesting.append(c)
# Starters that take part in compositions, and Hangul pieces.
starters = sorted({unicodedata.normalize("NFD", c)[0] for c in interesting})
hangul = [chr(x) for x in list(range(0x1100, 0x1113)) + list(range(0x1161, 0x1176)) + list(range(0x11A8, 0x11C3))]
hangul += [chr(0xAC00 + rng.randrange(11172)) for _ in range(20)]
pool = interesting + starters + hangul + list("aeiouAEIOU <>=")

cases = []
for c in interesting:  # every character that has a decomposition, a combining class or changes
    cases.append(c)
for _ in range(2000):  # random short sequences
    cases.append("".join(rng.choice(pool) for _ in range(rng.randint(2, 6))))
for s in cases:
    print(json.dumps([s, unicodedata.normalize("NFC", s)], ensure_ascii=False))
