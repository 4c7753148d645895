"""NVFP4 (ModelOpt layout) and per-tensor FP8 quantisation of a weight matrix, in plain torch.

Importable by other tools and tests:

    from nvfp4 import quantize_nvfp4, dequantize_nvfp4, quantize_fp8, dequantize_fp8

NVFP4, per linear W [N out, K in], K a multiple of 16 (see docs REFERENCE section 2):
  weight          U8       [N, K/2]   two E2M1 codes per byte: element 2i in the LOW nibble, 2i+1 HIGH
  weight_scale    F8_E4M3  [N, K/16]  one scale per 16 consecutive inputs
  weight_scale_2  F32      []         amax(|W|) / (6 * 448)
  dequantised:    W[n, k] = e2m1(code) * float(weight_scale[n, k // 16]) * weight_scale_2  (fp32, in that order)

Quantiser (the ModelOpt recipe, made exact):
  weight_scale_2 = amax(|W|) / 2688 (1.0 when W is all zeros)
  block scale    = e4m3(block_amax / (6 * weight_scale_2))   (round to nearest even; a zero scale becomes 1.0)
  code           = e2m1(W / (float(block scale) * weight_scale_2))  round to nearest, ties to the even code,
                   saturating at 6; the sign bit is the sign bit of the input (so -0.1 -> code 8, "-0").
All arithmetic in fp32.

FP8 per tensor: weight F8_E4M3 [N, K] = e4m3(W / s), weight_scale F32 [] s = amax(|W|) / 448.
"""
import torch

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
_E2M1_MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
E4M3_MAX = 448.0
E2M1_MAX = 6.0
BLOCK = 16


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 tensor -> uint8 E2M1 codes (0..15), round to nearest even, saturating at 6."""
    x = x.to(torch.float32)
    mag = x.abs().clamp(max=E2M1_MAX)
    mag = torch.where(torch.isnan(x), torch.full_like(mag, E2M1_MAX), mag)
    code = torch.zeros_like(mag, dtype=torch.int32)
    for m in _E2M1_MIDPOINTS:
        code += (mag > m).to(torch.int32)
    # Exactly on a midpoint between code i and i+1: the count above gives i; ties go to the even code.
    for i, m in enumerate(_E2M1_MIDPOINTS):
        tie = (mag == m) & (i % 2 == 1)
        code = torch.where(tie, torch.full_like(code, i + 1), code)
    sign = torch.signbit(x).to(torch.int32) << 3
    return (code | sign).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (0..15) -> fp32 values."""
    table = torch.tensor(E2M1_VALUES + [-v for v in E2M1_VALUES], dtype=torch.float32, device=codes.device)
    return table[(codes & 0xF).long()]


def quantize_nvfp4(w: torch.Tensor):
    """W [N, K] (any float dtype) -> dict(weight U8 [N, K/2], weight_scale float8_e4m3fn [N, K/16],
    weight_scale_2 f32 [])."""
    assert w.ndim == 2 and w.shape[1] % BLOCK == 0, f"NVFP4 needs K % 16 == 0, got {tuple(w.shape)}"
    n, k = w.shape
    w = w.to(torch.float32)
    amax = w.abs().max()
    scale_2 = (amax / (E2M1_MAX * E4M3_MAX)).to(torch.float32)
    if float(scale_2) == 0.0:
        scale_2 = torch.tensor(1.0, dtype=torch.float32)
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    block_scale = (block_amax / (E2M1_MAX * scale_2)).clamp(max=E4M3_MAX)
    block_scale_f8 = block_scale.to(torch.float8_e4m3fn)
    block_scale_f32 = block_scale_f8.to(torch.float32)
    # A zero (or underflowed) block scale would divide by zero: ModelOpt uses 1.0 there.
    zero = block_scale_f32 == 0
    block_scale_f8 = torch.where(zero, torch.ones_like(block_scale_f32), block_scale_f32).to(torch.float8_e4m3fn)
    block_scale_f32 = block_scale_f8.to(torch.float32)
    scaled = blocks / (block_scale_f32 * scale_2).unsqueeze(-1)
    codes = e2m1_codes(scaled).reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return {
        "weight": packed.contiguous(),
        "weight_scale": block_scale_f8.contiguous(),
        "weight_scale_2": scale_2.reshape(()).contiguous(),
    }


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """U8 [N, K/2] -> codes U8 [N, K] (low nibble first)."""
    n, half = packed.shape
    codes = torch.empty(n, half * 2, dtype=torch.uint8, device=packed.device)
    codes[:, 0::2] = packed & 0xF
    codes[:, 1::2] = packed >> 4
    return codes


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor):
    """The formula of REFERENCE section 2, in fp32: e2m1(code) * float(scale[n, k/16]) * scale_2."""
    codes = unpack_codes(weight)
    vals = e2m1_values(codes)
    n, k = vals.shape
    scale = weight_scale.to(torch.float32).repeat_interleave(BLOCK, dim=1)
    assert scale.shape == (n, k)
    return (vals * scale) * weight_scale_2.to(torch.float32)


def quantize_fp8(w: torch.Tensor):
    """W [N, K] -> dict(weight float8_e4m3fn [N, K], weight_scale f32 [])."""
    w = w.to(torch.float32)
    amax = w.abs().max()
    scale = (amax / E4M3_MAX).to(torch.float32)
    if float(scale) == 0.0:
        scale = torch.tensor(1.0, dtype=torch.float32)
    q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return {"weight": q.contiguous(), "weight_scale": scale.reshape(()).contiguous()}


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor):
    return weight.to(torch.float32) * weight_scale.to(torch.float32)


def _self_test():
    torch.manual_seed(0)
    w = torch.randn(8, 64) * 0.05
    w[0, :16] = 0.0  # an all-zero block
    q = quantize_nvfp4(w)
    d = dequantize_nvfp4(q["weight"], q["weight_scale"], q["weight_scale_2"])
    rel = ((d - w).abs().max() / w.abs().max()).item()
    assert rel < 0.1, rel
    assert torch.all(d[0, :16] == 0)
    codes = e2m1_codes(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -6.0]))
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 15], codes.tolist()
    f = quantize_fp8(w)
    assert ((dequantize_fp8(f["weight"], f["weight_scale"]) - w).abs().max() / w.abs().max()).item() < 0.07
    print("nvfp4 self-test ok, nvfp4 max rel err", rel)


if __name__ == "__main__":
    _self_test()
