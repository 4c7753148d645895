#!/usr/bin/env python3
"""Replaces the mtp.* tensors of a model folder's model.safetensors with those of a head-only file.

  python3 tools/tiny/merge_mtp_head.py models/kiln-tiny/model.safetensors mtp_head.safetensors

The GPU scripts return only the head a training run wrote (tools/gpu/spec_prefill_h200.sh `train`:
mtp_head.safetensors); this puts it into the shipped checkpoint without torch: the file's other tensors, their order
and its metadata stay as they are, and every mtp.* tensor must exist in both files with the same dtype and shape.
"""
import json
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nvfp4 import read_safetensors, tensor_bytes  # noqa: E402


def read(path):
    """(metadata, {name: (dtype, shape, bytes)}, names in data order) of one .safetensors file."""
    header, data = read_safetensors(path)
    meta = header.pop("__metadata__", None)
    tensors = {k: (v["dtype"], v["shape"], tensor_bytes(header, data, k)) for k, v in header.items()}
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    return meta, tensors, order


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    model_path, head_path = sys.argv[1], sys.argv[2]
    meta, tensors, order = read(model_path)
    _, head, _ = read(head_path)
    old = sorted(k for k in tensors if k.startswith("mtp."))
    new = sorted(k for k in head if k.startswith("mtp."))
    if old != new:
        sys.exit(f"the head's tensors differ from the model's: only in the model {sorted(set(old) - set(new))}, "
                 f"only in the head {sorted(set(new) - set(old))}")
    for k in new:
        if tensors[k][:2] != head[k][:2]:
            sys.exit(f"{k}: the model has {tensors[k][:2]}, the head {head[k][:2]}")
        tensors[k] = head[k]
    header, offset, blobs = {}, 0, []
    if meta is not None:
        header["__metadata__"] = meta
    for k in order:
        dtype, shape, blob = tensors[k]
        header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = model_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)
    os.replace(tmp, model_path)
    print(f"{model_path}: {len(new)} mtp.* tensors replaced ({sum(len(head[k][2]) for k in new)} bytes)")


if __name__ == "__main__":
    main()
