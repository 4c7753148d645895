#!/usr/bin/env python3
"""Creates kiln's image-input fixtures: small test images in several formats and modes, Pillow's decoding of
them (as transformers converts it) and what transformers' Qwen2-VL image processor (the one Qwen3.5 uses) makes
of them. The C++ tests (tests/unit/media/) compare kiln's decoder and processor with these.

Run it where torch, torchvision, transformers (5.17), Pillow, numpy and safetensors are installed (not needed
for building kiln), from the repository root:

    PYTHONUNBUFFERED=1 python3 tools/reference/make_image_fixtures.py

It writes tests/fixtures/media/ (about 1 MB):
    <case>.png / .jpg / .webp   the inputs
    processor_config.json       the processor settings used: configs/qwen3.5-397b-a17b-nvfp4/preprocessor_config.json
                                with a small pixel budget (size 1024..2048 pixels) so the tensors stay small
    expected.safetensors        per case <name>:
        <name>.decoded                U8  [H, W, 3]   Image.open + the default processor's convert_to_rgb
                                                      (cases up to 40,000 pixels; larger ones are PNGs)
        <name>.pixel_values           F32 [N, 3*T*P*P] the default AutoImageProcessor's pixel_values
        <name>.grid_thw               I64 [1, 3]       its image_grid_thw
        <name>.alt_pixel_values_t0    F32 [N, 3, P, P] the other backend's processor (PIL if the default is
                                                       torchvision, and the reverse), time index 0 only (the
                                                       script checks the T copies are equal)
        <name>.alt_grid_thw           I64 [1, 3]
    manifest.json               versions, the two processors' classes and backends, what convert_to_rgb does
                                with alpha ("drop" for Pillow's convert("RGB"), or "composite_on_white"), the cases
    README.md                   what this folder is and how to regenerate it

What it checks and prints: library versions (and Pillow's libjpeg-turbo / libwebp / zlib), which processor
class AutoImageProcessor picks and its backend, per case the Pillow mode, size, the target size against an
independent evaluation of smart_resize, the T copies, and how far the two backends are apart (in uint8 levels).
Deterministic: images come from fixed formulas and numpy RandomState seeds; no network (the processors are
built from the local config). A case that fails is reported and left out; the exit status is 1 if any did.
"""
import argparse
import io
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import traceback

SCRIPT_VERSION = 1
FIXTURE_MIN_PIXELS = 1024
FIXTURE_MAX_PIXELS = 2048
DECODED_MAX_PIXELS = 40000
SIZE_BUDGET_BYTES = 1_600_000

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log(msg=""):
    print(msg, flush=True)


# ---- versions ----


def versions():
    import numpy
    import PIL
    from PIL import features

    out = {
        "script_version": SCRIPT_VERSION,
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "Pillow": PIL.__version__,
    }
    for mod in ("torch", "torchvision", "transformers", "safetensors"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - recorded, not fatal here
            out[mod] = f"unavailable ({type(e).__name__}: {e})"
    for feat in ("jpg", "webp", "zlib", "libjpeg_turbo"):
        try:
            out[f"Pillow.{feat}"] = str(features.version(feat))
        except Exception:  # noqa: BLE001
            pass
    try:
        import torch

        out["torch.cpu_capability"] = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001
        pass
    return out


# ---- pictures ----


def picture(np, w, h, seed, noise):
    """RGB uint8 [h, w, 3]: smooth waves and ramps, a hard-edged rectangle and disc, optional noise."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 128 + 90 * np.sin(2 * np.pi * x / max(w, 8) * 1.5 + seed) * np.cos(2 * np.pi * y / max(h, 8))
    g = 40 + 170 * x / max(w - 1, 1)
    b = 200 - 150 * y / max(h - 1, 1)
    img = np.stack([r, g, b], -1)
    img[h // 4 : h // 2, w // 5 : w // 2] = [250, 30, 30]
    cy, cx, rad = 0.65 * h, 0.7 * w, 0.2 * min(w, h)
    img[(y - cy) ** 2 + (x - cx) ** 2 < rad**2] = [20, 60, 230]
    if noise:
        img = img + rng.randint(-noise, noise + 1, size=img.shape)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def alpha_plane(np, w, h):
    """Alpha with every kind of value: a ramp, a fully transparent block and a fully opaque block."""
    y, x = np.mgrid[0:h, 0:w]
    a = (x * 255 // max(w - 1, 1)).astype(np.int64)
    a = (a + 37 * (y % 3)) % 256
    a[: h // 3, : w // 3] = 0
    a[-(h // 3) :, -(w // 3) :] = 255
    return a.astype(np.uint8)


def encode(image, fmt, **params):
    buf = io.BytesIO()
    image.save(buf, fmt, **params)
    return buf.getvalue()


def riff_chunks(data, start, end):
    chunks = []
    pos = start
    while pos + 8 <= end:
        fourcc = data[pos : pos + 4]
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        chunks.append((fourcc, data[pos + 8 : pos + 8 + size]))
        pos += 8 + size + (size & 1)
    return chunks


def chunk(fourcc, payload):
    out = fourcc + len(payload).to_bytes(4, "little") + payload
    return out + (b"\0" if len(payload) & 1 else b"")


def still_webp(data):
    """kiln refuses animated WebP. Should this Pillow write a still image as a one-frame animation, unwrap the
    frame into a plain still file (the same bitstream chunks)."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WEBP", "not a WebP file"
    chunks = riff_chunks(data, 12, len(data))
    names = [c[0] for c in chunks]
    if b"VP8X" not in names:
        return data
    vp8x = chunks[names.index(b"VP8X")][1]
    if not (vp8x[0] & 0x02) and b"ANIM" not in names:
        return data
    frames = [p for n, p in chunks if n == b"ANMF"]
    if len(frames) != 1:
        raise ValueError(f"animated WebP with {len(frames)} frames")
    frame = frames[0]
    fx, fy = int.from_bytes(frame[0:3], "little"), int.from_bytes(frame[3:6], "little")
    fw, fh = int.from_bytes(frame[6:9], "little") + 1, int.from_bytes(frame[9:12], "little") + 1
    cw, ch = int.from_bytes(vp8x[4:7], "little") + 1, int.from_bytes(vp8x[7:10], "little") + 1
    if (fx, fy, fw, fh) != (0, 0, cw, ch):
        raise ValueError("one-frame animation whose frame does not cover the canvas")
    sub = riff_chunks(frame, 16, len(frame))
    body = b"".join(chunk(n, p) for n, p in sub if n in (b"ALPH", b"VP8 ", b"VP8L"))
    if any(n == b"ALPH" for n, _ in sub):
        header = bytes([0x10, 0, 0, 0]) + vp8x[4:10]  # alpha flag, the canvas size
        body = chunk(b"VP8X", header) + body
    log("      (Pillow wrote a one-frame animation; unwrapped it into a still WebP)")
    return b"RIFF" + (4 + len(body)).to_bytes(4, "little") + b"WEBP" + body


def make_cases(np, Image):
    """(name, extension, kind, bytes) for every case."""
    cases = []

    def rgb(w, h, seed, noise):
        return Image.fromarray(picture(np, w, h, seed, noise))

    def add(name, ext, kind, make):
        cases.append((name, ext, kind, make))

    add("png_rgb_17x23", "png", "lossless", lambda: encode(rgb(17, 23, 1, 20), "PNG"))
    add("png_rgb_20x12", "png", "lossless", lambda: encode(rgb(20, 12, 2, 20), "PNG"))
    add("png_rgb_300x200", "png", "lossless", lambda: encode(rgb(300, 200, 3, 0), "PNG"))
    add("png_rgb_641x479", "png", "lossless", lambda: encode(rgb(641, 479, 4, 0), "PNG"))

    def rgba():
        px = picture(np, 61, 47, 5, 12)
        return encode(Image.fromarray(np.dstack([px, alpha_plane(np, 61, 47)])), "PNG")

    add("png_rgba_61x47", "png", "lossless", rgba)

    def la():
        gray = picture(np, 33, 65, 6, 12)[:, :, 1]
        return encode(Image.fromarray(np.dstack([gray, alpha_plane(np, 33, 65)])), "PNG")

    add("png_la_33x65", "png", "lossless", la)
    add("png_gray_45x39", "png", "lossless", lambda: encode(Image.fromarray(np.ascontiguousarray(picture(np, 45, 39, 7, 15)[:, :, 0])), "PNG"))

    def palette():
        im = rgb(50, 30, 8, 6).quantize(colors=16, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        trns = bytes([0, 64, 128, 192] + [255] * 12)
        return encode(im, "PNG", transparency=trns)

    add("png_palette_50x30", "png", "lossless", palette)
    add("jpeg_baseline_97x67", "jpg", "lossy", lambda: encode(rgb(97, 67, 9, 10), "JPEG", quality=90))
    add(
        "jpeg_progressive_120x80",
        "jpg",
        "lossy",
        lambda: encode(rgb(120, 80, 10, 10), "JPEG", quality=85, progressive=True),
    )
    add(
        "jpeg_gray_64x32",
        "jpg",
        "lossy",
        lambda: encode(Image.fromarray(np.ascontiguousarray(picture(np, 64, 32, 11, 8)[:, :, 2])), "JPEG", quality=90),
    )
    add("jpeg_cmyk_40x40", "jpg", "lossy", lambda: encode(rgb(40, 40, 12, 6).convert("CMYK"), "JPEG", quality=95))
    add("webp_lossy_90x60", "webp", "lossy", lambda: still_webp(encode(rgb(90, 60, 13, 8), "WEBP", quality=80)))

    def webp_rgba():
        px = picture(np, 48, 80, 14, 12)
        im = Image.fromarray(np.dstack([px, alpha_plane(np, 48, 80)]))
        return still_webp(encode(im, "WEBP", lossless=True, quality=100))

    add("webp_lossless_rgba_48x80", "webp", "lossless", webp_rgba)
    return cases


# ---- processors ----


def backend_of(proc):
    b = getattr(type(proc), "backend", None)
    if isinstance(b, property):
        b = getattr(proc, "backend", None)
    if isinstance(b, str):
        return b
    name = type(proc).__name__
    if name.endswith("Fast"):
        return "torchvision"
    return "pil"


def build_processors(folder):
    import transformers
    from transformers import AutoImageProcessor

    default = AutoImageProcessor.from_pretrained(folder)
    dback = backend_of(default)
    want = "pil" if dback == "torchvision" else "torchvision"
    alt, notes = None, []
    try:
        cand = AutoImageProcessor.from_pretrained(folder, backend=want)
        if backend_of(cand) == want:
            alt = cand
        else:
            notes.append(f"AutoImageProcessor(backend={want!r}) gave {type(cand).__name__} ({backend_of(cand)})")
    except Exception as e:  # noqa: BLE001 - try the classes next
        notes.append(f"AutoImageProcessor(backend={want!r}): {type(e).__name__}: {e}")
    if alt is None:
        names = {
            "pil": ["Qwen2VLImageProcessorPil", "Qwen2VLImageProcessor"],
            "torchvision": ["Qwen2VLImageProcessorFast", "Qwen2VLImageProcessor"],
        }[want]
        modules = [
            "transformers",
            "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
            "transformers.models.qwen2_vl.image_processing_qwen2_vl",
            "transformers.models.qwen2_vl.image_processing_qwen2_vl_fast",
        ]
        for n in names:
            for m in modules:
                try:
                    cls = getattr(__import__(m, fromlist=[n]), n, None)
                    if cls is None:
                        continue
                    cand = cls.from_pretrained(folder)
                    if backend_of(cand) == want:
                        alt = cand
                        break
                except Exception as e:  # noqa: BLE001
                    notes.append(f"{m}.{n}: {type(e).__name__}: {e}")
            if alt is not None:
                break
    for n in notes:
        log(f"    note: {n}")
    return default, alt, transformers


def rgb_converter(proc):
    """The convert_to_rgb the processor applies to PIL images (its method, else transformers' global one)."""
    fn = getattr(proc, "convert_to_rgb", None)
    if callable(fn):
        return fn, f"{type(proc).__name__}.convert_to_rgb"

    return convert_to_rgb, "transformers.image_transforms.convert_to_rgb"


def alpha_behaviour(np, Image, convert):
    """'drop' (Pillow's convert("RGB") keeps the colour) or 'composite_on_white', probed on one pixel."""
    out = tuple(int(v) for v in np.asarray(convert(Image.new("RGBA", (1, 1), (10, 20, 30, 0))).convert("RGB"))[0, 0])
    if out == (10, 20, 30):
        return "drop"
    if out == (255, 255, 255):
        return "composite_on_white"
    return f"other {out}"


def run_processor(np, proc, image):
    try:
        out = proc(images=image, return_tensors="np")
    except Exception:  # noqa: BLE001 - some versions only return torch tensors
        out = proc(images=image, return_tensors="pt")

    def arr(v):
        return v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)

    return arr(out["pixel_values"]).astype(np.float32), arr(out["image_grid_thw"]).astype(np.int64)


def smart_resize(h, w, factor, min_pixels, max_pixels):
    """transformers' smart_resize, written out here to check the processor used the fixture budget."""
    h_bar = round(h / factor) * factor
    w_bar = round(w / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((h * w) / max_pixels)
        h_bar = max(factor, math.floor(h / beta / factor) * factor)
        w_bar = max(factor, math.floor(w / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        h_bar = math.ceil(h * beta / factor) * factor
        w_bar = math.ceil(w * beta / factor) * factor
    return h_bar, w_bar


# ---- main ----


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures", "media"))
    ap.add_argument(
        "--config", default=os.path.join(REPO, "configs", "qwen3.5-397b-a17b-nvfp4", "preprocessor_config.json")
    )
    args = ap.parse_args()

    import numpy as np
    from PIL import Image
    from safetensors.numpy import save_file

    vers = versions()
    log("versions:")
    for k, v in vers.items():
        log(f"  {k:24s} {v}")

    with open(args.config, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["size"] = {"longest_edge": FIXTURE_MAX_PIXELS, "shortest_edge": FIXTURE_MIN_PIXELS}
    for k in ("min_pixels", "max_pixels"):
        cfg.pop(k, None)
    P, T, M = cfg["patch_size"], cfg["temporal_patch_size"], cfg["merge_size"]
    factor = P * M
    log(f"processor config: {args.config} with size {cfg['size']}: patch {P}, temporal {T}, merge {M}")

    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(args.out):
        if name.split(".")[-1] in ("png", "jpg", "webp", "json", "safetensors", "md"):
            os.remove(os.path.join(args.out, name))
    cfg_text = json.dumps(cfg, indent=2) + "\n"
    with open(os.path.join(args.out, "processor_config.json"), "w", encoding="utf-8") as f:
        f.write(cfg_text)

    folder = tempfile.mkdtemp(prefix="kiln_image_processor_")
    try:
        with open(os.path.join(folder, "preprocessor_config.json"), "w", encoding="utf-8") as f:
            f.write(cfg_text)
        default, alt, transformers = build_processors(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    dinfo = {"class": type(default).__name__, "backend": backend_of(default)}
    ainfo = None if alt is None else {"class": type(alt).__name__, "backend": backend_of(alt)}
    log(f"default AutoImageProcessor: {dinfo['class']} (backend {dinfo['backend']}); runs on CPU tensors")
    log(f"other processor:            {'none found' if ainfo is None else ainfo['class'] + ' (backend ' + ainfo['backend'] + ')'}")
    if dinfo["backend"] != "torchvision":
        log("  NOTE: the default is not the torchvision backend (is torchvision installed?): kiln's default "
            "arithmetic follows transformers 5.x with torchvision")

    convert_to_rgb, convert_name = rgb_converter(default)
    alpha_mode = alpha_behaviour(np, Image, convert_to_rgb)
    log(f"decoded goldens: {convert_name}, alpha handling: {alpha_mode}")
    if alt is not None:
        alt_mode = alpha_behaviour(np, Image, rgb_converter(alt)[0])
        if alt_mode != alpha_mode:
            log(f"  NOTE: the other processor's convert_to_rgb handles alpha differently: {alt_mode}")

    tensors, manifest_cases, failures = {}, [], []
    std = min(cfg.get("image_std", [0.5]))
    for name, ext, kind, make in make_cases(np, Image):
        log(f"case {name}:")
        try:
            data = make()
            file_name = f"{name}.{ext}"
            with open(os.path.join(args.out, file_name), "wb") as f:
                f.write(data)
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                mode, (w, h) = im.mode, im.size
                rgb = np.asarray(convert_to_rgb(im), dtype=np.uint8)
            assert rgb.shape == (h, w, 3), rgb.shape
            log(f"    {file_name}: {len(data)} bytes, Pillow mode {mode}, {w} x {h}")
            if w * h <= DECODED_MAX_PIXELS:
                tensors[f"{name}.decoded"] = np.ascontiguousarray(rgb)
            else:
                assert ext == "png", "large cases must be lossless PNGs (kiln decodes them exactly)"

            eh, ew = smart_resize(h, w, factor, FIXTURE_MIN_PIXELS, FIXTURE_MAX_PIXELS)
            results = {}
            for label, proc in (("default", default), ("alt", alt)):
                if proc is None:
                    continue
                with Image.open(io.BytesIO(data)) as im:
                    im.load()
                    pv, grid = run_processor(np, proc, im)
                n = int(np.prod(grid[0]))
                assert grid.shape == (1, 3), grid.shape
                assert tuple(grid[0]) == (1, eh // P, ew // P), f"grid {tuple(grid[0])}, smart_resize gives {eh} x {ew}"
                assert pv.shape == (n, 3 * T * P * P), pv.shape
                blocks = pv.reshape(n, 3, T, P, P)
                for t in range(1, T):
                    assert np.array_equal(blocks[:, :, t], blocks[:, :, 0]), "temporal copies differ"
                results[label] = (pv, grid, blocks)
                log(f"    {label:7s} grid {tuple(int(g) for g in grid[0])} (resized {eh} x {ew}), pixel_values {pv.shape}, "
                    f"range [{pv.min():.4f}, {pv.max():.4f}]")
            pv, grid, _ = results["default"]
            tensors[f"{name}.pixel_values"] = np.ascontiguousarray(pv)
            tensors[f"{name}.grid_thw"] = np.ascontiguousarray(grid)
            if "alt" in results:
                apv, agrid, ablocks = results["alt"]
                tensors[f"{name}.alt_pixel_values_t0"] = np.ascontiguousarray(ablocks[:, :, 0])
                tensors[f"{name}.alt_grid_thw"] = np.ascontiguousarray(agrid)
                if apv.shape == pv.shape:
                    d = np.abs(apv.astype(np.float64) - pv.astype(np.float64))
                    log(f"    default vs alt: max |diff| {d.max():.3g} = {d.max() * 255 * std:.2f} uint8 levels, "
                        f"{int((d > 1e-6).sum())} of {d.size} values differ")
            manifest_cases.append({
                "name": name,
                "file": file_name,
                "format": {"png": "png", "jpg": "jpeg", "webp": "webp"}[ext],
                "lossless": kind == "lossless",
                "pil_mode": mode,
                "width": w,
                "height": h,
                "resized": [eh, ew],
                "decoded": f"{name}.decoded" in tensors,
            })
        except Exception as e:  # noqa: BLE001 - report, keep the other cases
            traceback.print_exc()
            failures.append(f"{name}: {type(e).__name__}: {e}")

    save_file(tensors, os.path.join(args.out, "expected.safetensors"),
              metadata={"generated_by": "tools/reference/make_image_fixtures.py", "script_version": str(SCRIPT_VERSION)})
    manifest = {
        "generated_by": "tools/reference/make_image_fixtures.py",
        "versions": vers,
        "processor_config": "processor_config.json",
        "convert_to_rgb": alpha_mode,
        "convert_to_rgb_function": convert_name,
        "default_processor": dinfo,
        "alt_processor": ainfo,
        "min_pixels": FIXTURE_MIN_PIXELS,
        "max_pixels": FIXTURE_MAX_PIXELS,
        "expected": "expected.safetensors",
        "cases": manifest_cases,
        "failures": failures,
    }
    with open(os.path.join(args.out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "README.md"), "w", encoding="utf-8") as f:
        f.write("# Image-input fixtures (generated)\n\n"
                "Written by `tools/reference/make_image_fixtures.py` (see its docstring for the contents); do not "
                "edit. Regenerate on a machine with torch, torchvision, transformers, Pillow, numpy and safetensors:\n\n"
                "    PYTHONUNBUFFERED=1 python3 tools/reference/make_image_fixtures.py\n\n"
                f"Generated with transformers {vers.get('transformers')}, torch {vers.get('torch')}, "
                f"torchvision {vers.get('torchvision')}, Pillow {vers.get('Pillow')}. Read by "
                "`tests/unit/media/image_decode_test.cpp` and `image_processor_test.cpp`.\n")

    total = sum(os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out))
    log(f"wrote {len(manifest_cases)} cases, {len(tensors)} tensors, {total} bytes in {args.out}")
    if total > SIZE_BUDGET_BYTES:
        log(f"WARNING: {total} bytes is above the {SIZE_BUDGET_BYTES}-byte budget for committed fixtures")
    if failures:
        log("FAILED cases:")
        for f_ in failures:
            log(f"  {f_}")
        return 1
    log("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
