#!/usr/bin/env python3
"""NVFP4 (ModelOpt layout) quantiser and dequantiser, written independently of kiln's C++ one.

Two implementations of the same rules:
  * pure Python (no numpy): `quantize_matrix`, `dequantize_matrix`, used by tests and to cross-check the
    output of `kiln quantize` (`python3 tools/tiny/nvfp4.py check MODEL_DIR [BF16_DIR]`);
  * torch (`fake_quant_experts`), used on the GPU for quantisation-aware training and to evaluate the
    NVFP4 model in transformers.

Rules (per quantised linear W [N out, K in], K a multiple of 16), every step in float32:
  weight_scale_2 = amax(|W|) / (6 * 448)
  block scale    = e4m3_rne_saturating((amax(|W[n, 16b:16b+16]|) / 6) / weight_scale_2)
  element        = e2m1_rne_saturating(W[n, k] / (float(block scale) * weight_scale_2))
                   (ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4)
  packed byte    = code[2i] | code[2i+1] << 4     (element 2i in the low nibble)
  dequantised    = e2m1(code) * float(block scale) * weight_scale_2
A block whose scale encodes to 0 dequantises to 0 (its codes are 0). A tensor of zeros gets
weight_scale_2 = 0 and all-zero scales and codes.
"""
import json
import math
import os
import struct
import sys

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# Midpoints between neighbouring magnitudes; at an exact midpoint the even code wins.
E2M1_MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
E4M3_MAX = 448.0
GROUP = 16


def f32(x):
    """Rounds a Python float to the nearest float32 (round-to-nearest-even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bf16_bits_to_float(bits):
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def e4m3_decode(code):
    """OCP E4M3FN: bias 7, S.1111.111 is NaN, max 448."""
    sign = -1.0 if code & 0x80 else 1.0
    e = (code >> 3) & 0xF
    m = code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * m * 2.0 ** -9
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


# Non-negative finite codes in value order (codes 0..0x7e are increasing in value).
_E4M3_POS = [(e4m3_decode(c), c) for c in range(0x7F)]


def e4m3_encode(x):
    """Round-to-nearest-even to E4M3FN, saturating at +-448 (NaN stays NaN)."""
    if math.isnan(x):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a >= E4M3_MAX:
        return sign | 0x7E
    # Binary search for the neighbours lo <= a < hi.
    lo, hi = 0, len(_E4M3_POS) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _E4M3_POS[mid][0] <= a:
            lo = mid
        else:
            hi = mid
    vlo, clo = _E4M3_POS[lo]
    vhi, chi = _E4M3_POS[hi]
    if a - vlo < vhi - a:
        c = clo
    elif a - vlo > vhi - a:
        c = chi
    else:
        c = clo if clo % 2 == 0 else chi
    return sign | c


def e2m1_encode(x):
    """Round-to-nearest-even to E2M1 (4-bit code), saturating at +-6."""
    sign = 0x8 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    idx = 0
    while idx < 7 and a > E2M1_MIDPOINTS[idx]:
        idx += 1
    # a <= midpoint[idx]: at an exact tie with the midpoint below an even code, round up.
    if idx < 7 and a == E2M1_MIDPOINTS[idx] and idx % 2 == 1:
        idx += 1
    return sign | idx


def e2m1_decode(code):
    v = E2M1_VALUES[code & 0x7]
    return -v if code & 0x8 else v


def quantize_matrix(rows):
    """rows: list of N lists of K floats (exactly representable in float32, e.g. BF16 values).
    Returns (packed [N][K/2] ints, scales [N][K/16] e4m3 codes, weight_scale_2 float32)."""
    k = len(rows[0])
    if k % GROUP:
        raise ValueError(f"K={k} is not a multiple of {GROUP}")
    amax = max(abs(v) for row in rows for v in row)
    s2 = f32(amax / f32(6.0 * E4M3_MAX))
    packed, scales = [], []
    for row in rows:
        prow, srow = [], []
        codes = []
        for b in range(k // GROUP):
            block = row[b * GROUP:(b + 1) * GROUP]
            bmax = max(abs(v) for v in block)
            scale_code = e4m3_encode(f32(f32(bmax / 6.0) / s2)) if s2 > 0 else 0
            srow.append(scale_code)
            eff = f32(e4m3_decode(scale_code) * s2)
            for v in block:
                codes.append(e2m1_encode(f32(v / eff)) if eff > 0 else 0)
        for i in range(0, k, 2):
            prow.append(codes[i] | (codes[i + 1] << 4))
        packed.append(prow)
        scales.append(srow)
    return packed, scales, s2


def dequantize_matrix(packed, scales, s2):
    """Inverse of quantize_matrix: [N][K] floats (float32 products, as kiln computes them)."""
    out = []
    for prow, srow in zip(packed, scales):
        row = []
        for i, byte in enumerate(prow):
            for code in (byte & 0xF, byte >> 4):
                k = len(row)
                scale = f32(e4m3_decode(srow[k // GROUP]) * s2)
                row.append(f32(e2m1_decode(code) * scale))
        out.append(row)
    return out


# ----------------------------------------------------------------------------------------------
# Minimal safetensors reading (pure Python) for checking kiln's output.


def read_safetensors(path):
    """Returns (header dict, data bytes) of one .safetensors file."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    return header, raw[8 + n:]


def tensor_bytes(header, data, name):
    b, e = header[name]["data_offsets"]
    return data[b:e]


def bf16_matrix(header, data, name, index=None):
    """A BF16 tensor [N, K] (or [E, N, K] slice `index`) as a list of rows of floats."""
    info = header[name]
    shape = info["shape"]
    assert info["dtype"] == "BF16", info
    raw = tensor_bytes(header, data, name)
    if index is not None:
        per = shape[1] * shape[2] * 2
        raw = raw[index * per:(index + 1) * per]
        shape = shape[1:]
    vals = struct.unpack(f"<{len(raw) // 2}H", raw)
    n, k = shape
    return [[bf16_bits_to_float(vals[r * k + c]) for c in range(k)] for r in range(n)]


def check_model(qdir, bf16_dir=None, max_tensors=6):
    """Checks a `kiln quantize` output: every expert quantised linear has the ModelOpt layout, and (with
    the BF16 source) its bytes equal this module's quantisation of the source weights. Checks the first
    `max_tensors` experts' projections (pure Python is slow). Returns the number of tensors compared."""
    qh, qd = read_safetensors(os.path.join(qdir, "model.safetensors"))
    if bf16_dir:
        bh, bd = read_safetensors(os.path.join(bf16_dir, "model.safetensors"))
    names = sorted(n for n in qh if n.endswith(".weight_scale_2"))
    compared = 0
    for name in names[:max_tensors]:
        base = name[: -len(".weight_scale_2")]
        w, s = qh[base + ".weight"], qh[base + ".weight_scale"]
        assert w["dtype"] == "U8" and s["dtype"] == "F8_E4M3", (w, s)
        assert qh[name]["dtype"] == "F32" and qh[name]["shape"] == [], qh[name]
        assert qh[base + ".input_scale"]["dtype"] == "F32"
        n, khalf = w["shape"]
        assert s["shape"] == [n, khalf * 2 // GROUP], (w, s)
        if not bf16_dir:
            continue
        # base = <prefix>.mlp.experts.<e>.<proj>; the source is fused or per expert
        prefix, e, proj = base.rsplit(".", 2)
        e = int(e)
        if base + ".weight" in bh:
            rows = bf16_matrix(bh, bd, base + ".weight")
        elif proj in ("gate_proj", "up_proj"):
            rows = bf16_matrix(bh, bd, prefix + ".gate_up_proj", e)
            half = len(rows) // 2
            rows = rows[:half] if proj == "gate_proj" else rows[half:]
        else:
            rows = bf16_matrix(bh, bd, prefix + ".down_proj", e)
        packed, scales, s2 = quantize_matrix(rows)
        got_w = tensor_bytes(qh, qd, base + ".weight")
        got_s = tensor_bytes(qh, qd, base + ".weight_scale")
        got_s2 = struct.unpack("<f", tensor_bytes(qh, qd, name))[0]
        assert got_s2 == s2, (name, got_s2, s2)
        assert got_s == bytes(c for row in scales for c in row), base + ".weight_scale differs"
        assert got_w == bytes(c for row in packed for c in row), base + ".weight differs"
        compared += 1
    return compared


# ----------------------------------------------------------------------------------------------
# torch implementation (GPU): fake quantisation of fused expert tensors.


def torch_quant_dequant(w, amax):
    """w [..., N, K] float32, amax [..., 1, 1] (the per-linear global amax). Returns the
    NVFP4-dequantised tensor, same rules as quantize_matrix."""
    import torch

    s2 = amax / (6.0 * E4M3_MAX)
    s2_safe = torch.where(s2 > 0, s2, torch.ones_like(s2))
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    bmax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = (bmax / 6.0) / s2_safe.unsqueeze(-1)
    scale_q = scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    eff = scale_q * s2_safe.unsqueeze(-1)
    x = torch.where(eff > 0, blocks / torch.where(eff > 0, eff, torch.ones_like(eff)), torch.zeros_like(blocks))
    mids = torch.tensor(E2M1_MIDPOINTS, device=w.device, dtype=torch.float32)
    vals = torch.tensor(E2M1_VALUES, device=w.device, dtype=torch.float32)
    a = x.abs()
    idx = torch.bucketize(a, mids)  # a <= mids[idx] (ties land on the lower index)
    tie_up = (idx < 7) & (idx % 2 == 1) & (a == mids[idx.clamp(max=6)])
    idx = idx + tie_up.long()
    q = vals[idx] * torch.sign(x)
    out = q * eff
    return out.reshape(w.shape)


def fake_quant_experts(w, fused_halves):
    """NVFP4 round trip of a fused expert tensor. gate_up_proj [E, 2I, H]: fused_halves=2 (gate and up
    are separate linears with their own global scale); down_proj [E, H, I]: fused_halves=1."""
    e, n, k = w.shape
    wf = w.float().reshape(e, fused_halves, n // fused_halves, k)
    amax = wf.abs().amax(dim=(2, 3), keepdim=True)  # [E, halves, 1, 1]
    return torch_quant_dequant(wf, amax).reshape(e, n, k).to(w.dtype)


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "check":
        n = check_model(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
        print(f"ok: layout checked, {n} tensors compared byte for byte")
        return
    print(__doc__)


if __name__ == "__main__":
    main()
