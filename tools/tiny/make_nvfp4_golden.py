#!/usr/bin/env python3
"""Writes tests/fixtures/nvfp4_golden.json: NVFP4 quantisations computed by the pure-Python
reference (tools/tiny/nvfp4.py), for kiln's C++ quantiser to match byte for byte.

  python3 tools/tiny/make_nvfp4_golden.py      (run from anywhere; rewrites the fixture)

Cases: a matrix whose first block sits exactly on every E2M1 rounding tie, a zero block, a block of tiny
values (subnormal E4M3 scale), blocks of seeded pseudo-random values at several magnitudes; plus scalar
E4M3/E2M1 encodings around their ties and limits.
"""
import json
import os
import random
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import nvfp4  # noqa: E402

OUT = os.path.join(HERE, "..", "..", "tests", "fixtures", "nvfp4_golden.json")


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def to_bf16_bits(x):
    """float -> bf16 bits, round to nearest even (x is first rounded to float32)."""
    u = f32_bits(x)
    u += 0x7FFF + ((u >> 16) & 1)
    return (u >> 16) & 0xFFFF


def matrix_case(name, rows_bf16, k):
    rows = [[nvfp4.bf16_bits_to_float(b) for b in r] for r in rows_bf16]
    packed, scales, s2 = nvfp4.quantize_matrix(rows)
    deq = nvfp4.dequantize_matrix(packed, scales, s2)
    return {
        "name": name, "n": len(rows), "k": k,
        "weight_bf16": [b for r in rows_bf16 for b in r],
        "packed": [b for r in packed for b in r],
        "scales": [c for r in scales for c in r],
        "weight_scale_2_f32_bits": f32_bits(s2),
        "dequantized_f32_bits": [f32_bits(v) for r in deq for v in r],
    }


def main():
    rng = random.Random(20240601)
    cases = []

    # Case 1: s2 = 2^-12 exactly (amax = 6 * 448 * 2^-12); block 0 of row 0 holds t * 448 * 2^-12 for
    # every E2M1 tie t, so W / (scale * s2) == t exactly.
    unit = 448.0 * 2.0 ** -12
    ties = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, 0]
    k = 48
    row0 = [to_bf16_bits(t * unit) for t in ties]
    row0 += [to_bf16_bits(rng.gauss(0, 0.05)) for _ in range(16)]
    row0 += [to_bf16_bits(rng.uniform(-0.3, 0.3)) for _ in range(16)]
    row1 = [0] * 16  # zero block
    row1 += [to_bf16_bits(rng.gauss(0, 5e-6)) for _ in range(16)]  # tiny: subnormal e4m3 scale
    row1 += [to_bf16_bits(rng.gauss(0, 0.01)) for _ in range(16)]
    rows = [row0, row1]
    for scale in (1.0, 0.3, 0.02):
        rows.append([to_bf16_bits(rng.gauss(0, 0.1 * scale)) for _ in range(k)])
    cases.append(matrix_case("ties_zero_tiny_random", rows, k))

    # Case 2: a typical weight matrix, 8 x 64, N(0, 0.02) with one outlier.
    rows = [[to_bf16_bits(rng.gauss(0, 0.02)) for _ in range(64)] for _ in range(8)]
    rows[3][17] = to_bf16_bits(0.4)
    cases.append(matrix_case("gaussian_with_outlier", rows, 64))

    e4m3 = []
    for v in [0.0, -0.0, 2.0 ** -10, 1.5 * 2.0 ** -10, 2.0 ** -9, 2.5 * 2.0 ** -9, 7.5 * 2.0 ** -9, 2.0 ** -6,
              0.06640625, 1.0, 1.0625, 1.1875, 1.9375, 100.0, 440.0, 448.0, 460.0, 500.0, 1e30, -3.3, 0.3]:
        e4m3.append([f32_bits(v), nvfp4.e4m3_encode(nvfp4.f32(v))])
    e2m1 = []
    for v in [0.0, -0.0, 0.1, 0.25, 0.2500001, 0.75, 0.7499999, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.0, 7.0, 100.0,
              -0.75, -2.5, -5.0, -7.0]:
        e2m1.append([f32_bits(v), nvfp4.e2m1_encode(nvfp4.f32(v))])

    doc = {
        "description": "NVFP4 goldens from tools/tiny/nvfp4.py (pure Python); regenerate with "
                       "python3 tools/tiny/make_nvfp4_golden.py. Do not edit.",
        "matrices": cases,
        "e4m3_cases_f32_bits_to_code": e4m3,
        "e2m1_cases_f32_bits_to_code": e2m1,
    }
    with open(OUT, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
