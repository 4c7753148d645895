#!/usr/bin/env python3
"""Continued training of kiln-tiny from the shipped NVFP4 model (warm start), weighted towards direct answers.

  PYTHONUNBUFFERED=1 python3 tools/tiny/continue_train.py --init-from models/kiln-tiny --out OUTDIR \
      [--train-seconds 300] [--total-seconds 390]

Needs torch, transformers (5.x), tokenizers, numpy (the GPU machine). The first stage (train.py) stopped
at 0.8 epoch: thinking mode was at 99% arithmetic but direct answers (no reasoning) at 74% (2-digit
products 52%). This stage:
 1. Loads models/kiln-tiny: BF16 tensors as they are, routed experts dequantised from NVFP4 into fp32
    master weights (exactly the shipped values), fused into transformers' [E, 2I, H] / [E, H, I] layout.
    The tokenizer, chat template and config are the shipped files, copied byte for byte.
 2. Checks the load before spending GPU time: greedy evaluation of the loaded model must reproduce the
    first stage's scores (a wrong load scores ~0), then a smoke test of every later code path.
 3. Corpus (gen_data.py's skills and renderer, fresh seeds) with the continuation mix CONTINUE_MIX:
    CONTINUE_THINK_SHARE of the conversations in thinking mode with the first stage's mix (to keep the
    reasoning skills), the rest direct answers weighted towards multiplication and subtraction; the other
    skills stay in both modes so nothing is forgotten.
 4. Trains for a wall-clock budget: AdamW (fresh state), linear warm-up, then cosine decay over the elapsed
    fraction of the budget (so the schedule ends when the time does); the last QAT_FRACTION of the time
    through an NVFP4 round trip of the routed experts (straight-through), as in the first stage. The
    tokens per step are picked by a short throughput probe (the model is small: a step is mostly fixed
    overhead, so a larger batch may give more tokens per second).
 5. Bakes QAT (experts = their NVFP4 round trip), saves BF16, archives the model into $OUT, then evaluates
    (eval.py: BF16 and NVFP4 variants, the same 860 prompts as the first stage), re-measures the
    calibration amax, and archives everything.
"""
import argparse
import copy
import json
import math
import os
import random
import shutil
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_data  # noqa: E402
import nvfp4  # noqa: E402

T0 = time.time()
SEED = 4321
CORPUS_SEED_BASE = 2_000_000   # the first stage used 1_000_000 + chunk: these are fresh draws
QAT_FRACTION = 0.3

# Conversation mix of the continuation. Thinking mode keeps the first stage's mix; direct mode (most of
# the conversations, and they are short: ~45 tokens against ~140) is weighted towards the weak skills.
CONTINUE_THINK_SHARE = 0.2
CONTINUE_MIX = {
    True: dict(gen_data.MIX[True]),
    False: {"mul": 50, "sub": 25, "add": 10, "ok": 6, "recall": 5, "self": 2, "greet": 2},
}
# Files of the shipped model folder that the BF16 checkpoint reuses unchanged.
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# Data


def generate_continue(seed, n):
    """n conversations of the continuation mix from one seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        thinking = rng.random() < CONTINUE_THINK_SHARE
        mix = CONTINUE_MIX[thinking]
        skill = rng.choices(list(mix), weights=list(mix.values()))[0]
        out.append(gen_data.make_conversation(rng, thinking, skill))
    return out


_TOK_JSON = None


def encode_conversations(tok, convs):
    """(flat int16 ids, lengths, prompt lengths, tags = skill index * 2 + thinking)."""
    import numpy as np
    rendered = [gen_data.render_example(c) for c in convs]
    pe = tok.encode_batch([p for p, _ in rendered], add_special_tokens=False)
    ce = tok.encode_batch([c for _, c in rendered], add_special_tokens=False)
    flat, lens, plens, tags = [], [], [], []
    for conv, p, c in zip(convs, pe, ce):
        ids = p.ids + c.ids
        flat.extend(ids)
        lens.append(len(ids))
        plens.append(len(p.ids))
        tags.append(gen_data.SKILLS.index(conv["skill"]) * 2 + int(conv["enable_thinking"]))
    return (np.asarray(flat, dtype=np.int16), np.asarray(lens, dtype=np.int32),
            np.asarray(plens, dtype=np.int32), np.asarray(tags, dtype=np.int8))


def _encode_chunk(job):
    from tokenizers import Tokenizer
    seed, n = job
    return encode_conversations(Tokenizer.from_str(_TOK_JSON), generate_continue(seed, n))


def join_parts(parts):
    import numpy as np
    lens = np.concatenate([p[1] for p in parts])
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return {"flat": np.concatenate([p[0] for p in parts]), "lens": lens,
            "plens": np.concatenate([p[2] for p in parts]), "tags": np.concatenate([p[3] for p in parts]),
            "offsets": offsets}


def start_corpus(tok_json, n_conv, chunk, workers):
    """Forks the worker pool and starts encoding in the background (call before CUDA is initialised)."""
    import multiprocessing as mp
    global _TOK_JSON
    _TOK_JSON = tok_json
    jobs = [(CORPUS_SEED_BASE + i, min(chunk, n_conv - i * chunk)) for i in range((n_conv + chunk - 1) // chunk)]
    pool = mp.get_context("fork").Pool(workers)
    return pool, pool.map_async(_encode_chunk, jobs)


def describe_corpus(corpus):
    lens, plens, tags = corpus["lens"], corpus["plens"], corpus["tags"]
    log(f"corpus: {len(lens)} conversations, {int(lens.sum())} tokens ({int((lens - plens).sum())} trained), "
        f"max length {int(lens.max())}, mean {lens.mean():.1f}")
    rows = {}
    for s, name in enumerate(gen_data.SKILLS):
        for th in (0, 1):
            sel = tags == s * 2 + th
            if sel.any():
                cl = lens[sel] - plens[sel]
                rows[f"{name}/{'think' if th else 'direct'}"] = {
                    "conversations": int(sel.sum()), "tokens": int(lens[sel].sum()),
                    "completion_mean": round(float(cl.mean()), 1)}
                log(f"  {name:6} {'think ' if th else 'direct'} {int(sel.sum()):8d} convs "
                    f"({100.0 * lens[sel].sum() / lens.sum():5.1f}% of tokens), completion mean {cl.mean():6.1f}")
    return rows


def fixed_batch(tok, convs, pad_id):
    """A right-padded batch (ids, labels) of the given conversations (loss on completions only)."""
    import numpy as np
    flat, lens, plens, _ = encode_conversations(tok, convs)
    width = int(lens.max())
    ids = np.full((len(lens), width), pad_id, dtype=np.int64)
    labels = np.full((len(lens), width), -100, dtype=np.int64)
    o = 0
    for r, (n, p) in enumerate(zip(lens.tolist(), plens.tolist())):
        seq = flat[o:o + n]
        ids[r, :n] = seq
        labels[r, p:n] = seq[p:]
        o += n
    return ids, labels


# ----------------------------------------------------------------------------------------------
# Loading the shipped NVFP4 checkpoint into fp32 master weights


def _tensor(dtype, shape, raw):
    import torch
    buf = bytearray(raw)
    if dtype == "BF16":
        return torch.frombuffer(buf, dtype=torch.bfloat16).float().reshape(shape)
    if dtype == "F32":
        return torch.frombuffer(buf, dtype=torch.float32).reshape(shape)
    if dtype in ("U8", "F8_E4M3"):
        return torch.frombuffer(buf, dtype=torch.uint8).reshape(shape)
    raise ValueError(f"unexpected dtype {dtype}")


_E2M1_VALUES = [nvfp4.e2m1_decode(c) for c in range(16)]
_E4M3_VALUES = [nvfp4.e4m3_decode(c) for c in range(256)]


def dequantize_nvfp4(packed, scale_codes, scale_2):
    """packed [N, K/2] uint8 (element 2i in the low nibble), scale_codes [N, K/16] uint8 (E4M3),
    scale_2 float32 scalar tensor -> [N, K] float32, computed like nvfp4.dequantize_matrix:
    float32(e2m1 * float32(e4m3 * scale_2))."""
    import torch
    e2m1 = torch.tensor(_E2M1_VALUES, dtype=torch.float32)
    e4m3 = torch.tensor(_E4M3_VALUES, dtype=torch.float32)
    n, khalf = packed.shape
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, 2 * khalf).long()
    scale = e4m3[scale_codes.long()] * scale_2.float()                    # [N, K/16] float32
    return e2m1[codes] * scale.repeat_interleave(nvfp4.GROUP, dim=1)


def load_shipped_state(model_dir, num_layers, num_experts):
    """State dict (float32) in transformers' module layout from a kiln-tiny NVFP4 folder: BF16 tensors
    upcast exactly, each layer's experts dequantised and fused (gate_up_proj [E, 2I, H] = gate rows then up
    rows; down_proj [E, H, I]). Every tensor of the file must be used (input_scale is calibration only)."""
    import torch
    header, data = nvfp4.read_safetensors(os.path.join(model_dir, "model.safetensors"))
    header.pop("__metadata__", None)
    used = set()

    def get(name):
        info = header[name]
        used.add(name)
        return _tensor(info["dtype"], info["shape"], nvfp4.tensor_bytes(header, data, name))

    def linear(prefix):
        w = get(prefix + ".weight")
        s = get(prefix + ".weight_scale")
        s2 = get(prefix + ".weight_scale_2")
        used.add(prefix + ".input_scale")
        if header[prefix + ".weight"]["dtype"] != "U8" or header[prefix + ".weight_scale"]["dtype"] != "F8_E4M3":
            raise ValueError(f"{prefix} is not NVFP4")
        return dequantize_nvfp4(w, s, s2)

    state = {}
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up, down = [], []
        for e in range(num_experts):
            gate_up.append(torch.cat([linear(f"{prefix}.{e}.gate_proj"), linear(f"{prefix}.{e}.up_proj")], 0))
            down.append(linear(f"{prefix}.{e}.down_proj"))
        state[prefix + ".gate_up_proj"] = torch.stack(gate_up)
        state[prefix + ".down_proj"] = torch.stack(down)
    for name, info in header.items():
        if ".mlp.experts." in name or name.startswith("mtp."):
            continue  # mtp.*: an MTP head (train_mtp.py), not part of the target
        if info["dtype"] != "BF16":
            raise ValueError(f"{name}: expected BF16, got {info['dtype']}")
        state[name] = get(name)
    unused = sorted(n for n in set(header) - used if not n.startswith("mtp."))
    if unused:
        raise ValueError(f"tensors not used by the loader: {unused[:10]}")
    return state


def build_model(cfg, state, experts_impl):
    import torch
    from transformers import Qwen3_5MoeForCausalLM
    torch.manual_seed(SEED)
    model = Qwen3_5MoeForCausalLM(cfg).float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:10]}, unexpected {unexpected[:10]}")
    model = model.cuda()
    if experts_impl != "eager":
        model.set_experts_implementation(experts_impl)
    model.train()
    return model


def pick_experts_impl(cfg, state, ids):
    """grouped_mm runs all experts in one kernel (faster); use it when it agrees with the eager loop."""
    import torch
    t_ids = torch.from_numpy(ids).cuda()
    logits = {}
    for impl in ("eager", "grouped_mm"):
        try:
            m = build_model(cfg, state, impl)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                logits[impl] = m(input_ids=t_ids, use_cache=False).logits.float()
            del m
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            log(f"experts implementation {impl} unusable: {type(e).__name__}: {e}")
    if "grouped_mm" in logits and "eager" in logits:
        diff = (logits["grouped_mm"] - logits["eager"]).abs().max().item()
        scale = logits["eager"].abs().max().item()
        log(f"grouped_mm vs eager logits: max |diff| {diff:.3g} (max |logit| {scale:.3g})")
        if diff <= 0.05 * scale:
            return "grouped_mm"
    return "eager"


# ----------------------------------------------------------------------------------------------
# Saving


def save_bf16(model, init_dir, model_dir):
    """BF16 checkpoint of a copy of `model` (the fp32 master stays) plus the shipped tokenizer, template and
    generation config, byte for byte. Returns the tensor names written."""
    import torch
    from safetensors import safe_open
    os.makedirs(model_dir, exist_ok=True)
    m = copy.deepcopy(model).to(torch.bfloat16)
    m.save_pretrained(model_dir)
    del m
    for name in COPIED_FILES:
        shutil.copyfile(os.path.join(init_dir, name), os.path.join(model_dir, name))
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
        dtypes = {str(f.get_slice(n).get_dtype()) for n in names}
    with open(os.path.join(init_dir, "config.json")) as f:
        want_cfg = json.load(f)
    with open(os.path.join(model_dir, "config.json")) as f:
        got_cfg = json.load(f)
    cfg_diff = {k: (want_cfg.get(k), got_cfg.get(k)) for k in set(want_cfg) | set(got_cfg)
                if want_cfg.get(k) != got_cfg.get(k)}
    log(f"saved {len(names)} tensors ({dtypes}) to {model_dir}; config.json differences vs shipped: {cfg_diff or 'none'}")
    return names


def archive(src_dir, entries, out_dir, stem="kt.tar"):
    """tar (uncompressed: BF16 weights barely compress) of `entries` under src_dir, split into 15 MB parts
    in out_dir (what the device tool brings back: files of at most 16 MB)."""
    if not out_dir:
        return
    present = [e for e in entries if os.path.exists(os.path.join(src_dir, e))]
    os.system(f"rm -f {out_dir}/{stem}.part-*")
    rc = os.system(f"tar -C {src_dir} -cf - {' '.join(present)} | split -b 15000000 - {out_dir}/{stem}.part-")
    log(f"archived {present} to {out_dir}/{stem}.part-* (rc {rc})")


# ----------------------------------------------------------------------------------------------


def val_loss(model, batch):
    """Mean completion-token cross-entropy of a fixed batch (no gradient; QAT parametrizations apply)."""
    import torch
    import torch.nn.functional as F
    ids, labels = (torch.from_numpy(x).cuda() for x in batch)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100).item()


def lr_at(step, frac, peak, warmup_steps, floor=0.05):
    """Linear warm-up over the first steps, then cosine from peak to floor * peak over the time fraction."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))


def train_for_time(model, opt, corpus, pad_id, args, budget, run_val, step_fn=None, qat_fn=None, device="cuda"):
    """The training loop, by wall clock: warm-up over the first steps, cosine over the elapsed fraction of
    `budget`, QAT for its last QAT_FRACTION; a throughput probe picks the tokens per step (steps 4-19 at
    args.tokens_per_step, 22-37 at twice that; the larger batch is kept if it gives 20% more tokens/s).
    Returns {"steps", "tokens", "seconds", "curve", "probe"}."""
    import torch
    import train as stage1
    step_fn = step_fn or stage1.train_step
    qat_fn = qat_fn or stage1.enable_qat
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    base_tpb = args.tokens_per_step
    batcher = stage1.Batcher(corpus, base_tpb, pad_id, SEED)
    probe, curve = {}, []
    step, tok_seen, qat_on = 0, 0, False
    ce_sum, aux_sum, n_sum = torch.zeros((), device=device), torch.zeros((), device=device), 0
    t_win, tok_win = None, 0
    next_val = args.val_every
    t_train = time.time()
    while True:
        frac = (time.time() - t_train) / budget
        if frac >= 1.0:
            break
        if step in (4, 22):
            sync()
            t_win, tok_win = time.time(), tok_seen
        if step in (20, 38):
            sync()
            tpb = base_tpb if step == 20 else 2 * base_tpb
            probe[str(tpb)] = {"tokens_per_s": round((tok_seen - tok_win) / (time.time() - t_win)),
                               "ms_per_step": round(1000 * (time.time() - t_win) / (step - (4 if step == 20 else 22)), 1)}
            log(f"probe: {tpb} tokens/step: {probe[str(tpb)]['ms_per_step']:.1f} ms/step, "
                f"{probe[str(tpb)]['tokens_per_s'] / 1e3:.0f}k tokens/s")
            if step == 20:
                batcher = stage1.Batcher(corpus, 2 * base_tpb, pad_id, SEED + 1)
            else:
                faster = probe[str(2 * base_tpb)]["tokens_per_s"] > 1.2 * probe[str(base_tpb)]["tokens_per_s"]
                probe["chosen"] = 2 * base_tpb if faster else base_tpb
                if not faster:
                    batcher = stage1.Batcher(corpus, base_tpb, pad_id, SEED + 2)
                log(f"probe: using {probe['chosen']} tokens per step")
        if frac >= 1.0 - QAT_FRACTION and not qat_on:
            qat_fn(model)
            qat_on = True
            log(f"step {step}: QAT on (NVFP4 round trip of the routed experts, straight-through)")
        lr = lr_at(step, frac, args.lr, args.warmup)
        ids, labels = batcher.next()
        ce, aux, gn = step_fn(model, opt, ids, labels, lr, qat_on)
        ce_sum += ce.detach()
        aux_sum += aux.detach()
        n_sum += 1
        tok_seen += ids.size
        step += 1
        if step % args.log_every == 0:
            now = time.time()
            row = {"step": step, "lr": lr, "ce": round(ce_sum.item() / n_sum, 5), "aux": round(aux_sum.item() / n_sum, 4),
                   "gnorm": round(float(gn), 4), "elapsed_s": round(now - t_train, 1), "tokens": tok_seen,
                   "epoch": batcher.epoch, "qat": qat_on}
            curve.append(row)
            log(f"step {step:5d} lr {lr:.2e} ce {row['ce']:.4f} aux {row['aux']:.3f} gnorm {row['gnorm']:.2f} "
                f"{tok_seen / (now - t_train) / 1e3:.0f}k tok/s epoch {batcher.epoch}{' QAT' if qat_on else ''}")
            ce_sum.zero_()
            aux_sum.zero_()
            n_sum = 0
        if step >= next_val:
            run_val(step, time.time() - t_train)
            next_val += args.val_every
    return {"steps": step, "tokens": tok_seen, "seconds": round(time.time() - t_train, 1), "curve": curve,
            "probe": probe}


def run(args):
    import numpy as np
    out_env = os.environ.get("OUT")
    os.makedirs(args.out, exist_ok=True)
    random.seed(SEED)
    np.random.seed(SEED)
    with open(os.path.join(args.init_from, "tokenizer.json"), encoding="utf-8") as f:
        tok_json = f.read()

    # Corpus workers start first (fork before CUDA), and encode while the GPU checks run.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    pool, pending = start_corpus(tok_json, args.conversations, 25_000, args.workers)
    log(f"corpus: {args.conversations} conversations encoding in {args.workers} processes")

    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3_5MoeTextConfig
    import eval as ev
    import train as stage1
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(SEED)
    tok = Tokenizer.from_str(tok_json)
    pad_id = tok.token_to_id("<|endoftext|>")
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")

    # 1. load
    cfg = Qwen3_5MoeTextConfig.from_pretrained(args.init_from)
    state = load_shipped_state(args.init_from, cfg.num_hidden_layers, cfg.num_experts)
    onto_grid = max((nvfp4.fake_quant_experts(state[n].cuda(), 2 if n.endswith("gate_up_proj") else 1)
                     - state[n].cuda()).abs().max().item() / state[n].abs().max().item()
                    for n in state if n.endswith("_proj") and ".experts." in n)
    log(f"loaded {len(state)} tensors from {args.init_from}; NVFP4 round trip of the dequantised experts moves "
        f"them by at most {onto_grid:.2e} of their amax")
    # One matrix against the pure-Python dequantiser (independent code path).
    hdr, data = nvfp4.read_safetensors(os.path.join(args.init_from, "model.safetensors"))
    p = "model.layers.5.mlp.experts.7.down_proj"
    n_out, khalf = hdr[p + ".weight"]["shape"]
    packed = list(nvfp4.tensor_bytes(hdr, data, p + ".weight"))
    scales = list(nvfp4.tensor_bytes(hdr, data, p + ".weight_scale"))
    s2 = float(_tensor("F32", [], nvfp4.tensor_bytes(hdr, data, p + ".weight_scale_2")))
    ref = nvfp4.dequantize_matrix([packed[r * khalf:(r + 1) * khalf] for r in range(n_out)],
                                  [scales[r * khalf // 8:(r + 1) * khalf // 8] for r in range(n_out)], s2)
    if torch.tensor(ref).ne(state["model.layers.5.mlp.experts.down_proj"][7]).any():
        raise RuntimeError("torch dequantisation differs from nvfp4.dequantize_matrix")
    log("dequantised experts match the pure-Python NVFP4 reference bit for bit")
    del hdr, data

    smoke_convs = generate_continue(99, 3000)
    smoke_batch = fixed_batch(tok, smoke_convs[:256], pad_id)
    impl = pick_experts_impl(cfg, state, smoke_batch[0][:64])
    log(f"using experts implementation: {impl}")

    # 2. the loaded model must score like the shipped one (a wrong load scores ~0)
    items = ev.build_items(args.eval_per_mode)
    init_dir = os.path.join(args.work, "init_model")
    model = build_model(cfg, state, impl)
    total, experts, active = stage1.count_params(model)
    log(f"model: {total / 1e6:.2f}M parameters ({experts / 1e6:.2f}M routed experts), {active / 1e6:.2f}M active")
    save_bf16(model, args.init_from, init_dir)
    init_items = copy.deepcopy(items)
    init_summary = ev.run_eval(init_dir, init_items, args.max_new_think, args.max_new_direct, variants=("bf16",), log=log)
    try:
        ev.check_hf_tokenizer(init_dir, init_items[:50] + init_items[-50:], log=log)
    except Exception:  # noqa: BLE001 - informative only
        log("hf tokenizer check failed:\n" + traceback.format_exc())
    row = init_summary["bf16"]
    think_acc = row["think"]["arith"]["correct"] / row["think"]["arith"]["n"]
    direct_acc = row["direct"]["arith"]["correct"] / row["direct"]["arith"]["n"]
    if think_acc < 0.9 or direct_acc < 0.5:
        raise RuntimeError(f"the loaded model scores {think_acc:.3f} / {direct_acc:.3f} (think / direct arithmetic): "
                           f"the warm start is wrong")

    # 3. smoke test of the training path on a throwaway copy
    sm = copy.deepcopy(model)
    opt = stage1.make_optimizer(sm, args.lr)
    b = stage1.Batcher(join_parts([encode_conversations(tok, smoke_convs)]), 16384, pad_id, SEED)
    for s in range(4):
        if s == 2:
            stage1.enable_qat(sm)
        ce, aux, gn = stage1.train_step(sm, opt, *b.next(), args.lr * 0.01, s >= 2)
        log(f"smoke step {s}: ce {ce.item():.4f} aux {aux.item():.3f} gnorm {gn.item():.3f}")
    log(f"smoke val loss (QAT on): {val_loss(sm, smoke_batch):.4f}")
    stage1.bake_qat(sm)
    sm.eval()
    save_bf16(sm, args.init_from, os.path.join(args.work, "smoke_model"))
    stage1.calibrate(os.path.join(args.work, "smoke_model"), stage1.sample_texts(tok, 8, 99),
                     os.path.join(args.work, "smoke_calib.json"))
    del sm, opt, b
    torch.cuda.empty_cache()
    log("smoke test passed")
    if args.smoke_only:
        pool.terminate()
        return

    # 4. corpus, validation batches
    parts = pending.get()
    pool.close()
    pool.join()
    corpus = join_parts(parts)
    del parts
    corpus_rows = describe_corpus(corpus)
    rng = random.Random(777)
    val_sets = {
        "direct_mul": fixed_batch(tok, [gen_data.make_conversation(rng, False, "mul") for _ in range(512)], pad_id),
        "direct_sub": fixed_batch(tok, [gen_data.make_conversation(rng, False, "sub") for _ in range(512)], pad_id),
        "direct_add": fixed_batch(tok, [gen_data.make_conversation(rng, False, "add") for _ in range(512)], pad_id),
        "think_mix": fixed_batch(tok, gen_data.generate(778, 384, "think"), pad_id),
        "direct_mix": fixed_batch(tok, gen_data.generate(779, 512, "direct"), pad_id),
    }

    # 5. training
    budget = min(args.train_seconds, T0 + args.total_seconds - args.reserve_seconds - time.time())
    log(f"training for {budget:.0f}s (peak lr {args.lr}, {args.warmup} warm-up steps, "
        f"QAT for the last {QAT_FRACTION:.0%} of the time)")
    val_curve = []

    def run_val(step, elapsed):
        model.eval()
        row = {"step": step, "elapsed_s": round(elapsed, 1)}
        row.update({k: round(val_loss(model, v), 5) for k, v in val_sets.items()})
        model.train()
        val_curve.append(row)
        log("val " + " ".join(f"{k} {v}" for k, v in row.items()))

    model.train()
    run_val(0, 0.0)
    opt = stage1.make_optimizer(model, args.lr)
    res = train_for_time(model, opt, corpus, pad_id, args, budget, run_val)
    step, tok_seen, train_time = res["steps"], res["tokens"], res["seconds"]
    log(f"trained {step} steps, {tok_seen / 1e6:.1f}M tokens (padded) in {train_time:.0f}s")
    stage1.bake_qat(model)
    run_val(step, train_time)
    model.eval()

    # 6. save, archive, evaluate, calibrate
    model_dir = os.path.join(args.out, "model")
    save_bf16(model, args.init_from, model_dir)
    meta = {"stage": "continued from the shipped NVFP4 kiln-tiny", "seed": SEED, "corpus_seed_base": CORPUS_SEED_BASE,
            "think_share": CONTINUE_THINK_SHARE, "mix": {str(k): v for k, v in CONTINUE_MIX.items()},
            "conversations": int(len(corpus["lens"])), "corpus": corpus_rows,
            "steps": step, "train_seconds": round(train_time, 1), "tokens_padded": tok_seen,
            "probe": res["probe"], "lr": args.lr, "warmup": args.warmup,
            "qat_fraction": QAT_FRACTION, "experts_implementation": impl, "curve": res["curve"], "val_curve": val_curve,
            "init_eval": init_summary}
    with open(os.path.join(args.out, "train_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    model = opt = None  # free the GPU for the evaluation
    torch.cuda.empty_cache()
    archive(args.out, ["model", "train_meta.json"], out_env)
    summaries = ev.run_eval(model_dir, items, args.max_new_think, args.max_new_direct,
                            deadline=T0 + args.total_seconds - 6, log=log)
    ev.write_json(os.path.join(args.out, "eval_prompts.json"), items, summaries)
    meta["eval"] = summaries
    with open(os.path.join(args.out, "train_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    try:
        ev.check_hf_tokenizer(model_dir, items[:100] + items[-100:], log=log)
    except Exception:  # noqa: BLE001 - informative only
        log("hf tokenizer check failed:\n" + traceback.format_exc())
    try:
        stage1.calibrate(model_dir, stage1.sample_texts(tok, 512, 4242), os.path.join(args.out, "calib_amax.json"))
    except Exception:  # noqa: BLE001 - the model and eval are already saved
        log("calibration failed:\n" + traceback.format_exc())
    archive(args.out, ["model", "train_meta.json", "eval_prompts.json", "calib_amax.json"], out_env)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init-from", default=os.path.join(HERE, "..", "..", "models", "kiln-tiny"),
                    help="shipped NVFP4 model folder to continue from")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/kiln_tiny_continue_work")
    ap.add_argument("--train-seconds", type=float, default=300)
    ap.add_argument("--total-seconds", type=float, default=390, help="deadline for the whole script")
    ap.add_argument("--reserve-seconds", type=float, default=45, help="kept after training: save, eval, calibration")
    ap.add_argument("--conversations", type=int, default=1_600_000)
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--val-every", type=int, default=250)
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--eval-per-mode", type=int, default=300, help="arithmetic prompts per mode (860 prompts in all)")
    ap.add_argument("--max-new-think", type=int, default=340)
    ap.add_argument("--max-new-direct", type=int, default=48)
    ap.add_argument("--smoke-only", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    try:
        run(args)
    except Exception:
        log("FAILED:\n" + traceback.format_exc())
        sys.exit(1)
    log("done")


if __name__ == "__main__":
    main()
