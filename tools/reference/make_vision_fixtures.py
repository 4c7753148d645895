#!/usr/bin/env python3
"""Creates kiln's vision reference fixtures: the Qwen3.5 vision tower and a tiny whole multimodal Qwen3.5-MoE, with
what Hugging Face transformers computes for them.

Run it where torch + transformers (5.17) + safetensors are installed (not needed for building kiln):

    PYTHONUNBUFFERED=1 python3 tools/reference/make_vision_fixtures.py --out tests/fixtures/reference

Fixtures (each folder: model/ with config.json + model.safetensors, expected.safetensors, manifest.json):

qwen3_5_vision/   transformers' own Qwen3_5MoeVisionModel with a small random config that keeps the real layouts
    (patch 16, temporal patch 2, merge 2, 3 channels; depth 2, hidden 64, 4 heads (head dim 16), intermediate 128,
    out_hidden 96, a 4 x 4 learned position grid, hidden_act gelu_pytorch_tanh as the release). Weights are stored
    under the checkpoint's names (model.visual.*) in BF16; config.json is a whole Qwen3_5MoeConfig (its text part only
    names a hidden size of 96 = out_hidden_size; there are no text weights). Three images in one call: grid_thw
    [1,4,6], [1,6,8] and [2,2,2] (two frames: each frame attends only to itself). expected.safetensors:
        pixel_values  F32 [N, 1536]   N = 24 + 48 + 8 patches, the processor's layout (see model/qwen3_5_vision.h)
        grid_thw      I32 [3, 3]
        embed         F32 [N, 64]     after the patch embedding + interpolated position embedding (block 0's input)
        block0        F32 [N, 64]     after block 0
        output        F32 [N/4, 96]   the merger's output (pooler_output): the image embeddings
qwen3_5_moe_vl/   a tiny Qwen3_5MoeForConditionalGeneration: the text model of make_fixtures.py's qwen3_5_moe fixture
    (hidden 64, 4 layers [linear x3, full], 8 experts, vocab 512, M-RoPE sections [2, 1, 1] interleaved, theta 1e7)
    with a vision tower of depth 1, hidden 32, 2 heads, intermediate 64, an 8 x 8 position grid, out_hidden 64; image
    tokens inside the 512 vocabulary (vision_start 498, vision_end 499, image_pad 500, video_pad 501), config.json as
    the release lays it out (text_config / vision_config / top-level token ids). All weights BF16. One prompt: 5 text
    tokens, <|vision_start|>, 6 x <|image_pad|> (one 64 x 96-pixel image: grid_thw [1, 4, 6]), <|vision_end|>, 5 text
    tokens. expected.safetensors:
        input_ids          I32 [L]      L = 18
        mm_token_type_ids  I32 [L]      1 on the image pads
        pixel_values       F32 [24, 1536], image_grid_thw I32 [1, 3]
        image_embeds       F32 [6, 64]  the vision tower's output (what replaces the pads)
        position_ids       I32 [3, L]   transformers' get_rope_index (t, h, w rows)
        rope_deltas        I32 [1]      max position + 1 - L
        prefill_logits     F32 [L, 512] every position
        greedy_tokens      I32 [8]      step 0 = argmax of the prefill's last row; step s feeds token s-1
        greedy_logits      F32 [8, 512] row s chose greedy_tokens[s]
        decode_positions   I32 [7]      the (t = h = w) position of the token fed at step s = 1..7: L - 1 + s + delta

Reference computation: transformers runs in float32 on the CPU (eager attention, no fused kernels), with weights equal
to the stored BF16 values (upcast), so the fixture is the model's maths on the stored weights; kiln's CPU backend
computes in fp32 too. Seeds are fixed: the same versions give the same files.

Self-checks (printed, and in each manifest): the stored tensor names are the names kiln expects; the vision output is
recomputed from the maths in float64 by this script (tower_from_maths, written from model/qwen3_5_vision.h's steps,
not from transformers' code) and compared; two runs are bitwise equal; the M-RoPE positions are recomputed by this
script's reading of get_rope_index; cached greedy decoding equals one uncached pass. A self-check that disagrees is
reported as a WARNING (the files are still written: transformers is the oracle), a crash as FAILED (exit code 1).
"""
import argparse
import json
import os
import sys
import traceback

SCRIPT_VERSION = 1

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (the text model's config, weight init and safetensors writer)

PATCH, TEMPORAL, MERGE, CHANNELS = 16, 2, 2, 3
PATCH_DIM = CHANNELS * TEMPORAL * PATCH * PATCH  # 1536

VISION_A = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=96,
                num_position_embeddings=16, hidden_act="gelu_pytorch_tanh", in_channels=CHANNELS,
                patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE)
GRIDS_A = [[1, 4, 6], [1, 6, 8], [2, 2, 2]]
SEED_A = 2001

VISION_B = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                num_position_embeddings=64, hidden_act="gelu_pytorch_tanh", in_channels=CHANNELS,
                patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE)
GRID_B = [1, 4, 6]
SEED_B = 2002
TOKENS_B = dict(vision_start_token_id=498, vision_end_token_id=499, image_token_id=500, video_token_id=501)
GREEDY_STEPS_B = 8

MATHS_REL_TOL = 1e-5  # fp32 transformers vs the float64 maths: expect ~1e-7


def log(*a):
    print(*a, flush=True)


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


# ---------------------------------------------------------------------------------------------------------------
# Vision tower: names, weights, the maths

def expected_vision_names(vc):
    """model.visual.* names kiln's loader reads (format::expected_vision_tensors), without the prefix."""
    names = ["patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight"]
    for i in range(vc["depth"]):
        b = f"blocks.{i}."
        names += [b + s for s in ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "attn.qkv.weight",
                                  "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias", "mlp.linear_fc1.weight",
                                  "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")]
    names += ["merger.norm.weight", "merger.norm.bias", "merger.linear_fc1.weight", "merger.linear_fc1.bias",
              "merger.linear_fc2.weight", "merger.linear_fc2.bias"]
    return sorted(names)


@torch.no_grad()
def init_vision(visual, seed):
    """Random weights for a vision tower (a module whose parameter names are the checkpoint's after model.visual.),
    scaled so activations stay O(1), rounded to bf16 (the stored values)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(visual.named_parameters()):
        shape = tuple(p.shape)
        if name == "pos_embed.weight":
            v = torch.randn(shape, generator=g) * 0.5
        elif ".norm" in "." + name and name.endswith(".weight"):  # LayerNorm: plain weight (not zero-centred)
            v = 1.0 + torch.randn(shape, generator=g) * 0.1
        elif name.endswith(".bias"):
            v = torch.randn(shape, generator=g) * 0.1
        elif name == "patch_embed.proj.weight":
            v = torch.randn(shape, generator=g) / PATCH_DIM ** 0.5
        elif p.ndim == 2:
            v = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        else:
            raise RuntimeError(f"no init rule for vision parameter {name} {shape}")
        p.copy_(v.to(torch.bfloat16).to(torch.float32))


def vision_state(visual):
    """The tower's parameters (what a checkpoint stores; non-persistent buffers such as inv_freq are not in it)."""
    return {k: v.detach().clone() for k, v in visual.named_parameters()}


def check_vision_names(state, vc):
    """True when transformers' parameter names are exactly the ones kiln's loader reads (else a WARNING: the files are
    still written under transformers' names, and kiln's loader will list what it misses)."""
    got = sorted(state.keys())
    want = expected_vision_names(vc)
    if got != want:
        log("  WARNING: transformers' vision parameter names are not the ones kiln reads:\n    only transformers: "
            f"{sorted(set(got) - set(want))}\n    only kiln: {sorted(set(want) - set(got))}")
        return False
    log(f"  names: the {len(got)} model.visual.* tensors are the ones kiln's loader reads")
    return True


def random_pixels(grids, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn((n, PATCH_DIM), generator=g)


def block_order(grids):
    """(row, col, segment) of every patch row, the processor's merge-block order per frame."""
    rows, cols, seg = [], [], []
    s = 0
    for t, h, w in grids:
        for _ in range(t):
            for br in range(h // MERGE):
                for bc in range(w // MERGE):
                    for ir in range(MERGE):
                        for ic in range(MERGE):
                            rows.append(br * MERGE + ir)
                            cols.append(bc * MERGE + ic)
                            seg.append(s)
            s += 1
    return rows, cols, seg


@torch.no_grad()
def tower_from_maths(state, vc, pixel_values, grids, theta=10000.0):
    """The steps of model/qwen3_5_vision.h in float64, written from the maths (not transformers' code).
    Returns (embed, after block 0, output)."""
    d = {k: v.double() for k, v in state.items()}
    h, heads = vc["hidden_size"], vc["num_heads"]
    D = h // heads
    side = int(round(vc["num_position_embeddings"] ** 0.5))
    x = pixel_values.double() @ d["patch_embed.proj.weight"].reshape(h, -1).T + d["patch_embed.proj.bias"]
    rows, cols, seg = block_order(grids)
    # bilinear, align-corners resampling of the side x side grid to each image's grid
    E = d["pos_embed.weight"].reshape(side, side, h)
    pos = []
    i = 0
    for t, gh, gw in grids:
        for _ in range(t * gh * gw):
            r, c = rows[i], cols[i]
            sr = r * (side - 1) / (gh - 1) if gh > 1 else 0.0
            sc = c * (side - 1) / (gw - 1) if gw > 1 else 0.0
            r0, c0 = int(sr), int(sc)
            r1, c1 = min(r0 + 1, side - 1), min(c0 + 1, side - 1)
            dr, dc = sr - r0, sc - c0
            pos.append((1 - dr) * (1 - dc) * E[r0, c0] + (1 - dr) * dc * E[r0, c1] + dr * (1 - dc) * E[r1, c0]
                       + dr * dc * E[r1, c1])
            i += 1
    x = x + torch.stack(pos)
    embed = x.clone()
    # rotary: dims [0, D/4) turn with the row, [D/4, D/2) with the column; partners at + D/2
    inv = theta ** (-torch.arange(0, D // 4, dtype=torch.float64) * 2 / (D // 2))
    r_t = torch.tensor(rows, dtype=torch.float64)[:, None]
    c_t = torch.tensor(cols, dtype=torch.float64)[:, None]
    ang = torch.cat([r_t * inv, c_t * inv], dim=1)  # [N, D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], 1)[:, None, :], torch.cat([ang.sin(), ang.sin()], 1)[:, None, :]

    def rot(v):  # v [N, heads, D]
        v1, v2 = v[..., : D // 2], v[..., D // 2:]
        return v * cos + torch.cat([-v2, v1], dim=-1) * sin

    seg_t = torch.tensor(seg)
    mask = seg_t[:, None] == seg_t[None, :]  # each frame attends to itself only, both directions
    N = x.shape[0]
    after0 = None
    for b in range(vc["depth"]):
        p = f"blocks.{b}."
        xn = F.layer_norm(x, (h,), d[p + "norm1.weight"], d[p + "norm1.bias"], eps=1e-6)
        qkv = xn @ d[p + "attn.qkv.weight"].T + d[p + "attn.qkv.bias"]
        q, k, v = qkv[:, :h].reshape(N, heads, D), qkv[:, h:2 * h].reshape(N, heads, D), qkv[:, 2 * h:].reshape(N, heads, D)
        q, k = rot(q), rot(k)
        scores = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
        scores = scores.masked_fill(~mask[None], float("-inf"))
        att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(N, h)
        x = x + att @ d[p + "attn.proj.weight"].T + d[p + "attn.proj.bias"]
        xn = F.layer_norm(x, (h,), d[p + "norm2.weight"], d[p + "norm2.bias"], eps=1e-6)
        a = F.gelu(xn @ d[p + "mlp.linear_fc1.weight"].T + d[p + "mlp.linear_fc1.bias"], approximate="tanh")
        x = x + a @ d[p + "mlp.linear_fc2.weight"].T + d[p + "mlp.linear_fc2.bias"]
        if b == 0:
            after0 = x.clone()
    xn = F.layer_norm(x, (h,), d["merger.norm.weight"], d["merger.norm.bias"], eps=1e-6).reshape(N // MERGE ** 2, -1)
    a = F.gelu(xn @ d["merger.linear_fc1.weight"].T + d["merger.linear_fc1.bias"])  # exact (erf) GELU
    out = a @ d["merger.linear_fc2.weight"].T + d["merger.linear_fc2.bias"]
    return embed, after0, out


def pick_output(out, rows, cols):
    """The merged [rows, cols] tensor from whatever the vision model returns (ModelOutput, tuple, tensor)."""
    cands = []
    if torch.is_tensor(out):
        cands.append(out)
    for attr in ("pooler_output", "last_hidden_state"):
        v = getattr(out, attr, None)
        if torch.is_tensor(v):
            cands.append(v)
    if isinstance(out, (tuple, list)):
        cands += [v for v in out if torch.is_tensor(v)]
    for c in cands:
        if tuple(c.shape) == (rows, cols):
            return c
    raise RuntimeError(f"no [{rows}, {cols}] output among {[tuple(c.shape) for c in cands]}")


def rotary_theta(visual):
    """The theta transformers' vision rotary uses, read back from its inv_freq (inv_freq[1] = theta^(-2/(D/2)))."""
    inv = getattr(getattr(visual, "rotary_pos_emb", None), "inv_freq", None)
    if inv is None or inv.numel() < 2:
        return None, None
    half = 2 * inv.numel()  # D/2
    return float(inv[1].double() ** (-half / 2.0)), inv.numel()


def vision_taps(visual):
    """Hooks on blocks[0]: its input (patch + position embedding) and output."""
    taps = {}

    def pre(mod, args, kwargs):
        taps["embed"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

    def post(mod, args, kwargs, out):
        taps["block0"] = (out[0] if isinstance(out, (tuple, list)) else out).detach().clone()

    h1 = visual.blocks[0].register_forward_pre_hook(pre, with_kwargs=True)
    h2 = visual.blocks[0].register_forward_hook(post, with_kwargs=True)
    return taps, (h1, h2)


def set_eager(model, cfg):
    for c in (cfg, getattr(cfg, "vision_config", None), getattr(cfg, "text_config", None)):
        if c is not None:
            try:
                c._attn_implementation = "eager"
            except Exception:
                pass
    try:
        model.set_attn_implementation("eager")
    except Exception:
        pass


def write_config(cfg, model_dir, architecture):
    os.makedirs(model_dir, exist_ok=True)
    cfg.architectures = [architecture]
    try:
        cfg.dtype = torch.bfloat16
    except Exception:
        pass
    cfg.save_pretrained(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------------------
# Fixture A: the vision tower alone

def make_vision_fixture(out_root, versions):
    import transformers
    name = "qwen3_5_vision"
    log(f"=== {name}")
    text = dict(mf.FAMILIES["qwen3_5_moe"]["config"], hidden_size=VISION_A["out_hidden_size"])
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=dict(VISION_A))
    vcfg = cfg.vision_config
    try:
        vcfg._attn_implementation = "eager"
    except Exception:
        pass
    torch.manual_seed(SEED_A)
    visual = transformers.Qwen3_5MoeVisionModel(vcfg)
    set_eager(visual, vcfg)
    visual = visual.float().eval()
    init_vision(visual, SEED_A)
    state = vision_state(visual)
    names_ok = check_vision_names(state, VISION_A)
    theta, quarter = rotary_theta(visual)
    log(f"  transformers vision rotary: theta {theta}, {quarter} frequencies (head dim {VISION_A['hidden_size'] // VISION_A['num_heads']})")

    pixels = random_pixels(GRIDS_A, SEED_A + 1)
    grid = torch.tensor(GRIDS_A, dtype=torch.long)
    n_tokens = pixels.shape[0] // MERGE ** 2
    taps, hooks = vision_taps(visual)
    with torch.no_grad():
        out = pick_output(visual(pixels, grid_thw=grid), n_tokens, VISION_A["out_hidden_size"]).float().clone()
        taps_first = dict(taps)
        out2 = pick_output(visual(pixels, grid_thw=grid), n_tokens, VISION_A["out_hidden_size"]).float()
    for h in hooks:
        h.remove()
    deterministic = bool(torch.equal(out, out2))
    m_embed, m_block0, m_out = tower_from_maths(state, VISION_A, pixels, GRIDS_A, theta or 10000.0)
    checks = {"rel_l2_embed_vs_maths": rel_l2(taps_first["embed"], m_embed),
              "rel_l2_block0_vs_maths": rel_l2(taps_first["block0"], m_block0),
              "rel_l2_output_vs_maths": rel_l2(out, m_out),
              "two_runs_bitwise_equal": deterministic,
              "names_are_kilns": names_ok,
              "rotary_theta": theta}
    for k, v in checks.items():
        log(f"  self-check {k}: {v}")
    warnings = [k for k in ("rel_l2_embed_vs_maths", "rel_l2_block0_vs_maths", "rel_l2_output_vs_maths")
                if not checks[k] < MATHS_REL_TOL]
    if not deterministic:
        warnings.append("two_runs_bitwise_equal")
    if not names_ok:
        warnings.append("names_are_kilns")
    for w in warnings:
        log(f"  WARNING: self-check {w} failed ({checks[w]}): transformers and model/qwen3_5_vision.h's maths "
            "disagree; the C++ test will show where (embed / block0 / output)")

    fixture_dir = os.path.join(out_root, name)
    model_dir = os.path.join(fixture_dir, "model")
    written = write_config(cfg, model_dir, "Qwen3_5MoeForConditionalGeneration")
    mf.save_safetensors({"model.visual." + k: v.to(torch.bfloat16) for k, v in state.items()},
                        os.path.join(model_dir, "model.safetensors"))
    expected = {"pixel_values": pixels.contiguous(),
                "grid_thw": grid.to(torch.int32).contiguous(),
                "embed": taps_first["embed"].float().contiguous(),
                "block0": taps_first["block0"].float().contiguous(),
                "output": out.contiguous()}
    mf.save_safetensors(expected, os.path.join(fixture_dir, "expected.safetensors"))
    manifest = {"generated_by": "tools/reference/make_vision_fixtures.py", "script_version": SCRIPT_VERSION,
                "versions": versions, "model_class": "Qwen3_5MoeVisionModel",
                "reference": "transformers float32 on CPU, eager attention; weights = the stored bf16 values",
                "vision_config": written.get("vision_config"), "grid_thw": GRIDS_A,
                "shapes": {k: list(v.shape) for k, v in expected.items()},
                "self_checks": checks, "warnings": warnings,
                "checkpoint_bytes": os.path.getsize(os.path.join(model_dir, "model.safetensors")),
                "expected_bytes": os.path.getsize(os.path.join(fixture_dir, "expected.safetensors"))}
    with open(os.path.join(fixture_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    log(f"  output {list(out.shape)}; files {manifest['checkpoint_bytes'] + manifest['expected_bytes']} bytes")
    return manifest


# ---------------------------------------------------------------------------------------------------------------
# Fixture B: the whole multimodal model

def rope_index_by_reading(ids, tt, grid, merge):
    """get_rope_index as model/qwen3_5_vision.h's neighbours will implement it: text positions run on; an image's
    tokens get (t, h, w) = start + (frame, row, col) of the merged grid; text after it starts at start + max(h, w)."""
    pos, cur, i, L = [], 0, 0, len(ids)
    while i < L:
        if tt[i] == 0:
            pos.append((cur, cur, cur))
            cur += 1
            i += 1
            continue
        t, h, w = grid[0], grid[1] // merge, grid[2] // merge
        for f in range(t):
            for r in range(h):
                for c in range(w):
                    pos.append((cur + f, cur + r, cur + c))
        i += t * h * w
        cur += max(h, w)
    p = torch.tensor(pos, dtype=torch.long).T  # [3, L]
    return p, int(p.max()) + 1 - L


def call_with_mm(fn, mm, **kw):
    """fn(**kw, mm_token_type_ids=mm), or without it on a transformers that does not take it."""
    try:
        return fn(**kw, mm_token_type_ids=mm)
    except TypeError as e:
        if "mm_token_type_ids" not in str(e):
            raise
        log(f"  note: this transformers takes no mm_token_type_ids ({e}); calling without")
        return fn(**kw)


def make_multimodal_fixture(out_root, versions):
    import transformers
    name = "qwen3_5_moe_vl"
    log(f"=== {name}")
    fam = mf.FAMILIES["qwen3_5_moe"]
    cfg = transformers.Qwen3_5MoeConfig(text_config=dict(fam["config"]), vision_config=dict(VISION_B),
                                        tie_word_embeddings=False, **TOKENS_B)
    set_eager(None, cfg)
    torch.manual_seed(SEED_B)
    model = transformers.Qwen3_5MoeForConditionalGeneration(cfg)
    set_eager(model, cfg)
    model = model.float().eval()
    mf.init_weights(model.model.language_model, dict(fam, seed=SEED_B))
    with torch.no_grad():
        g = torch.Generator().manual_seed(SEED_B + 3)
        w = model.lm_head.weight
        w.copy_((torch.randn(tuple(w.shape), generator=g) * 2.0 / w.shape[-1] ** 0.5).to(torch.bfloat16).float())
    init_vision(model.model.visual, SEED_B + 1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    vis = {k[len("model.visual."):]: v for k, v in state.items() if k.startswith("model.visual.")}
    names_ok = check_vision_names(vis, VISION_B)
    others = sorted(k for k in state if not (k.startswith("model.visual.") or k.startswith("model.language_model.")
                                             or k == "lm_head.weight"))
    if others:
        log(f"  WARNING: tensors outside model.visual. / model.language_model. / lm_head: {others}")
        names_ok = False

    gen = torch.Generator().manual_seed(SEED_B + 7)
    text_a = torch.randint(0, 480, (5,), generator=gen).tolist()
    text_b = torch.randint(0, 480, (5,), generator=gen).tolist()
    n_pad = GRID_B[0] * GRID_B[1] * GRID_B[2] // MERGE ** 2
    ids_list = (text_a + [TOKENS_B["vision_start_token_id"]] + [TOKENS_B["image_token_id"]] * n_pad
                + [TOKENS_B["vision_end_token_id"]] + text_b)
    tt_list = [1 if t == TOKENS_B["image_token_id"] else 0 for t in ids_list]
    L = len(ids_list)
    ids = torch.tensor([ids_list], dtype=torch.long)
    tt = torch.tensor([tt_list], dtype=torch.int32)
    pixels = random_pixels([GRID_B], SEED_B + 5)
    grid = torch.tensor([GRID_B], dtype=torch.long)

    with torch.no_grad():
        image_embeds = pick_output(model.model.visual(pixels, grid_thw=grid), n_pad,
                                   VISION_B["out_hidden_size"]).float().clone()
        _, _, m_out = tower_from_maths({k: v for k, v in vis.items()}, VISION_B, pixels, [GRID_B],
                                       rotary_theta(model.model.visual)[0] or 10000.0)
        rope_index = None
        try:
            try:
                rope_index = model.model.get_rope_index(ids, mm_token_type_ids=tt, image_grid_thw=grid)
            except TypeError:
                rope_index = model.model.get_rope_index(ids, image_grid_thw=grid)
        except Exception as e:  # the forward's own positions (captured below) are stored instead
            log(f"  note: get_rope_index failed ({type(e).__name__}: {e}); using the positions the forward passes")
        read_pos, read_delta = rope_index_by_reading(ids_list, tt_list, GRID_B, MERGE)

        # Prefill + greedy through the cache (positions after the prompt come from the model's rope_deltas). The
        # language model's inputs are captured: the image pads' rows of inputs_embeds must be image_embeds, and its
        # position_ids are the M-RoPE positions the model really used.
        captured = {}

        def grab(mod, args, kwargs):
            for key in ("inputs_embeds", "position_ids"):
                if torch.is_tensor(kwargs.get(key)) and key not in captured:
                    captured[key] = kwargs[key].detach().clone()

        hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
        model.model.rope_deltas = None
        try:
            out = call_with_mm(model, tt, input_ids=ids, pixel_values=pixels, image_grid_thw=grid, use_cache=True)
        finally:
            hook.remove()
        prefill = out.logits[0].float().clone()
        cache = out.past_key_values
        rows = [prefill[-1].clone()]
        chosen = [int(torch.argmax(prefill[-1]))]
        for _ in range(1, GREEDY_STEPS_B):
            out = model(input_ids=torch.tensor([[chosen[-1]]], dtype=torch.long), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0, -1].float().clone())
            chosen.append(int(torch.argmax(rows[-1])))
        greedy_logits = torch.stack(rows)
        # One uncached pass over prompt + greedy tokens (M-RoPE positions recomputed from the whole sequence).
        full_ids = torch.tensor([ids_list + chosen[:-1]], dtype=torch.long)
        full_tt = torch.tensor([tt_list + [0] * (len(chosen) - 1)], dtype=torch.int32)
        model.model.rope_deltas = None
        full = call_with_mm(model, full_tt, input_ids=full_ids, pixel_values=pixels, image_grid_thw=grid,
                            use_cache=False).logits[0].float()
    # [3, L] (t, h, w). The forward may pass 4 rows (text positions first) or 3.
    fwd_pos = captured.get("position_ids")
    if fwd_pos is not None:
        fwd_pos = fwd_pos.reshape(fwd_pos.shape[0], -1)[-3:].long()
    if rope_index is not None:
        position_ids = rope_index[0][:, 0, :].clone().long()
        delta = int(torch.as_tensor(rope_index[1]).reshape(-1)[0])
    elif fwd_pos is not None:
        position_ids = fwd_pos.clone()
        delta = int(position_ids.max()) + 1 - L
    else:
        raise RuntimeError("neither get_rope_index nor the forward gave M-RoPE positions")
    top2 = torch.topk(greedy_logits, 2, dim=-1).values
    placed = captured["inputs_embeds"][0][torch.tensor(tt_list) == 1].float() if "inputs_embeds" in captured else None
    checks = {"rel_l2_placed_rows_vs_image_embeds": rel_l2(placed, image_embeds) if placed is not None else None,
              "rel_l2_image_embeds_vs_maths": rel_l2(image_embeds, m_out),
              "positions_equal_script_reading": bool(torch.equal(position_ids, read_pos)) and delta == read_delta,
              "positions_equal_forward": None if fwd_pos is None else bool(torch.equal(position_ids, fwd_pos)),
              "cached_vs_uncached_max_abs": (full[L - 1:] - greedy_logits).abs().max().item(),
              "prefill_vs_uncached_max_abs": (full[:L] - prefill).abs().max().item(),
              "min_top2_gap": (top2[:, 0] - top2[:, 1]).min().item(),
              "names_are_kilns": names_ok,
              "rope_delta": delta}
    for k, v in checks.items():
        log(f"  self-check {k}: {v}")
    log(f"  position_ids t {position_ids[0].tolist()}\n               h {position_ids[1].tolist()}\n"
        f"               w {position_ids[2].tolist()}")
    log(f"  greedy {chosen}")
    warnings = []
    if checks["rel_l2_placed_rows_vs_image_embeds"] is None or not checks["rel_l2_placed_rows_vs_image_embeds"] < 1e-6:
        warnings.append("rel_l2_placed_rows_vs_image_embeds")
    if not checks["rel_l2_image_embeds_vs_maths"] < MATHS_REL_TOL:
        warnings.append("rel_l2_image_embeds_vs_maths")
    for key in ("positions_equal_script_reading", "positions_equal_forward"):
        if not checks[key]:
            warnings.append(key)
    if not checks["cached_vs_uncached_max_abs"] < 1e-3:
        warnings.append("cached_vs_uncached_max_abs")
    if not names_ok:
        warnings.append("names_are_kilns")
    for w in warnings:
        log(f"  WARNING: self-check {w} failed ({checks[w]})")

    fixture_dir = os.path.join(out_root, name)
    model_dir = os.path.join(fixture_dir, "model")
    written = write_config(cfg, model_dir, "Qwen3_5MoeForConditionalGeneration")
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": mf.GENERATION_EOS, "do_sample": False}, f, indent=2)
    mf.save_safetensors({k: v.to(torch.bfloat16) for k, v in state.items()}, os.path.join(model_dir, "model.safetensors"))
    expected = {"input_ids": torch.tensor(ids_list, dtype=torch.int32),
                "mm_token_type_ids": torch.tensor(tt_list, dtype=torch.int32),
                "pixel_values": pixels.contiguous(),
                "image_grid_thw": grid.to(torch.int32).contiguous(),
                "image_embeds": image_embeds.contiguous(),
                "position_ids": position_ids.to(torch.int32).contiguous(),
                "rope_deltas": torch.tensor([delta], dtype=torch.int32),
                "prefill_logits": prefill.contiguous(),
                "greedy_tokens": torch.tensor(chosen, dtype=torch.int32),
                "greedy_logits": greedy_logits.contiguous(),
                "decode_positions": torch.tensor([L - 1 + s + delta for s in range(1, GREEDY_STEPS_B)],
                                                 dtype=torch.int32)}
    mf.save_safetensors(expected, os.path.join(fixture_dir, "expected.safetensors"))
    manifest = {"generated_by": "tools/reference/make_vision_fixtures.py", "script_version": SCRIPT_VERSION,
                "versions": versions, "model_class": "Qwen3_5MoeForConditionalGeneration",
                "reference": "transformers float32 on CPU, eager attention, torch fallback conv / gated delta rule; "
                             "weights = the stored bf16 values",
                "vocab_size": mf.VOCAB, "tokens": TOKENS_B, "image_grid_thw": [GRID_B], "prompt_length": L,
                "greedy_steps": GREEDY_STEPS_B, "text_config": written.get("text_config"),
                "vision_config": written.get("vision_config"),
                "shapes": {k: list(v.shape) for k, v in expected.items()},
                "self_checks": checks, "warnings": warnings,
                "checkpoint_bytes": os.path.getsize(os.path.join(model_dir, "model.safetensors")),
                "expected_bytes": os.path.getsize(os.path.join(fixture_dir, "expected.safetensors"))}
    with open(os.path.join(fixture_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    log(f"  files {manifest['checkpoint_bytes'] + manifest['expected_bytes']} bytes")
    return manifest


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder (tests/fixtures/reference)")
    ap.add_argument("--only", default="", help="qwen3_5_vision and/or qwen3_5_moe_vl, comma-separated (default: both)")
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    import safetensors
    import transformers
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "safetensors": safetensors.__version__, "python": sys.version.split()[0]}
    log("versions", versions)
    if not transformers.__version__.startswith("5.17"):
        log(f"  note: written for transformers 5.17, running {transformers.__version__}")
    for cls in ("Qwen3_5MoeConfig", "Qwen3_5MoeVisionModel", "Qwen3_5MoeForConditionalGeneration"):
        log(f"  {cls}: {'ok' if hasattr(transformers, cls) else 'MISSING'}")
    only = set(filter(None, args.only.split(",")))
    failures, summary = [], {}
    for name, fn in (("qwen3_5_vision", make_vision_fixture), ("qwen3_5_moe_vl", make_multimodal_fixture)):
        if only and name not in only:
            continue
        try:
            m = fn(args.out, versions)
            summary[name] = {"warnings": m["warnings"], **{k: v for k, v in m["self_checks"].items()}}
        except Exception:
            traceback.print_exc()
            failures.append(name)
    log(json.dumps(summary, indent=1))
    if failures:
        log("FAILED:", failures)
        sys.exit(1)
    if any(s["warnings"] for s in summary.values()):
        log("written, WITH WARNINGS (see above)")
    else:
        log("all vision fixtures written, every self-check passed")


if __name__ == "__main__":
    main()
