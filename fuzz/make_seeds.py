#!/usr/bin/env python3
"""Writes the fuzzer's seed inputs into fuzz/seeds/ (small valid and near-valid safetensors files,
prefixed with the mode byte 0 = whole file, see safetensors_header_fuzz.cpp). Regenerate: python3 fuzz/make_seeds.py"""
import json, os, struct

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds")
os.makedirs(here, exist_ok=True)

def st(tensors, meta=None, pad=True):
    header, data, off = {}, b"", 0
    if meta is not None:
        header["__metadata__"] = meta
    for name, dtype, shape, blob in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(blob)]}
        data += blob
        off += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data

seeds = {
    "two_tensors": st([("a", "BF16", [2, 3], bytes(12)), ("b.weight", "F32", [1], bytes(4))], {"format": "pt"}),
    "scalar_and_empty": st([("s", "F32", [], bytes(4)), ("e", "U8", [0, 4], b"")]),
    "fp4_layout": st([("x.weight", "U8", [4, 8], bytes(32)), ("x.weight_scale", "F8_E4M3", [4, 1], bytes(4)),
                      ("x.weight_scale_2", "F32", [], bytes(4))]),
    "empty_header": st([]),
}
for name, blob in seeds.items():
    with open(os.path.join(here, name), "wb") as f:
        f.write(b"\x00" + blob)
