#!/usr/bin/env python3
"""Trains kiln-tiny end to end on one GPU: corpus -> tokenizer -> qwen3_5_moe model -> eval.

  PYTHONUNBUFFERED=1 python3 tools/tiny/train.py --out OUTDIR [--train-seconds 270] [--smoke-only]

Needs torch, transformers (5.x, Qwen3_5MoeForCausalLM), tokenizers, numpy. Steps:
 1. Tokenizer: byte-level BPE trained on 200k rendered conversations (tokenizer_build.py).
 2. Corpus: N conversations from gen_data.py (seeded per chunk, 16 processes), rendered with the
    Qwen3.5 template, tokenized; loss only on the assistant's completion (reasoning, </think>, answer,
    <|im_end|>). Thinking and non-thinking conversations ~50/50.
 3. Smoke test of every later code path on a throwaway model (a few steps, QAT, save, reload, eval,
    calibration), so a bug costs seconds, not the whole run.
 4. Training for a wall-clock budget: AdamW, linear warm-up then cosine decay (the step count is
    sized from the measured step time), bf16 autocast, fixed seeds, router load-balancing loss. The
    last QAT_FRACTION of the steps train through an NVFP4 round trip of the routed experts
    (straight-through estimator) so the shipped NVFP4 model keeps the BF16 model's accuracy.
 5. Save (save_pretrained, BF16 safetensors), check tensor names/dtypes, write the model folder's
    other files, then evaluate (eval.py) and calibrate activation ranges for input_scale.
Everything lands in OUTDIR (model/, logs, eval json, calibration json).
"""
import argparse
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
import tokenizer_build  # noqa: E402

T0 = time.time()
SEED = 1234
BPE_VOCAB = 2048
QAT_FRACTION = 0.2

# The model: every part of qwen3_5_moe at a size a single CPU core decodes quickly.
ARCH = dict(
    hidden_size=256,
    num_hidden_layers=8,            # [linear, linear, linear, full] x 2
    num_attention_heads=4,          # gated full attention: q (and gate) 4 x 64
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,         # Gated DeltaNet: q/k 2 x 64, v 4 x 64 (value head h reads key head h // 2)
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    initializer_range=0.02,
    tie_word_embeddings=False,
    attention_bias=False,
    attention_dropout=0.0,
    router_aux_loss_coef=0.001,
    output_router_logits=False,
    use_cache=True,
)
ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2], "mrope_interleaved": True}


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# Data


_TOK_JSON = None


def _encode_chunk(args):
    """Worker: generate, render and tokenize one seeded chunk. Returns flat int16 ids, lengths, prompt
    lengths and a per-conversation tag (skill index * 2 + thinking)."""
    import numpy as np
    from tokenizers import Tokenizer
    seed, n = args
    tok = Tokenizer.from_str(_TOK_JSON)
    convs = gen_data.generate(seed, n, "mix")
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


def build_corpus(tok, n_conv, chunk, workers):
    import multiprocessing as mp
    import numpy as np
    global _TOK_JSON
    _TOK_JSON = tok.to_str()
    jobs = [(1_000_000 + i, min(chunk, n_conv - i * chunk)) for i in range((n_conv + chunk - 1) // chunk)]
    with mp.get_context("fork").Pool(workers) as pool:
        parts = pool.map(_encode_chunk, jobs)
    flat = np.concatenate([p[0] for p in parts])
    lens = np.concatenate([p[1] for p in parts])
    plens = np.concatenate([p[2] for p in parts])
    tags = np.concatenate([p[3] for p in parts])
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return {"flat": flat, "lens": lens, "plens": plens, "tags": tags, "offsets": offsets}


class Batcher:
    """Length-bucketed batches of about `tokens_per_batch` padded tokens, reshuffled every epoch."""

    def __init__(self, corpus, tokens_per_batch, pad_id, seed):
        self.c = corpus
        self.tpb = tokens_per_batch
        self.pad_id = pad_id
        self.rng = random.Random(seed)
        self.epoch = 0
        self.batches = []

    def _new_epoch(self):
        import numpy as np
        n = len(self.c["lens"])
        perm = np.random.default_rng(self.rng.randrange(1 << 30)).permutation(n)
        # Stable sort of a random permutation by length bucket: random members, similar lengths.
        keys = self.c["lens"][perm] // 8
        order = perm[np.argsort(keys, kind="stable")]
        lens = self.c["lens"].tolist()
        batches, cur, cur_max = [], [], 0
        for i in order.tolist():
            length = lens[i]
            m = max(cur_max, length)
            if cur and m * (len(cur) + 1) > self.tpb:
                batches.append(cur)
                cur, m = [], length
            cur.append(i)
            cur_max = m
        if cur:
            batches.append(cur)
        self.rng.shuffle(batches)
        self.batches = batches
        self.epoch += 1

    def next(self):
        import numpy as np
        if not self.batches:
            self._new_epoch()
        idx = self.batches.pop()
        width = int(max(self.c["lens"][i] for i in idx))
        ids = np.full((len(idx), width), self.pad_id, dtype=np.int64)
        labels = np.full((len(idx), width), -100, dtype=np.int64)
        for r, i in enumerate(idx):
            o, n, p = int(self.c["offsets"][i]), int(self.c["lens"][i]), int(self.c["plens"][i])
            seq = self.c["flat"][o:o + n]
            ids[r, :n] = seq
            labels[r, p:n] = seq[p:]
        return ids, labels


# ----------------------------------------------------------------------------------------------
# Model


def make_config(vocab_size, pad_id, eos_id):
    from transformers import Qwen3_5MoeTextConfig
    layer_types = ["linear_attention" if (i + 1) % 4 else "full_attention"
                   for i in range(ARCH["num_hidden_layers"])]
    return Qwen3_5MoeTextConfig(vocab_size=vocab_size, rope_parameters=dict(ROPE), layer_types=layer_types,
                                pad_token_id=pad_id, bos_token_id=None, eos_token_id=eos_id, **ARCH)


def count_params(model):
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    cfg = model.config
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    active = total - experts + cfg.num_hidden_layers * cfg.num_experts_per_tok * per_expert
    return total, experts, active


class FakeQuantSTE:
    """Parametrization: forward value is the NVFP4 round trip, gradient passes straight through."""

    @staticmethod
    def make(halves):
        import torch
        import nvfp4

        class _P(torch.nn.Module):
            def forward(self, w):
                wd = w.detach()
                return w + (nvfp4.fake_quant_experts(wd, halves) - wd)

        return _P()


def enable_qat(model):
    from torch.nn.utils import parametrize
    for layer in model.model.layers:
        ex = layer.mlp.experts
        parametrize.register_parametrization(ex, "gate_up_proj", FakeQuantSTE.make(2))
        parametrize.register_parametrization(ex, "down_proj", FakeQuantSTE.make(1))


def bake_qat(model):
    """Ends QAT: the experts' weights become exactly their NVFP4 round trip."""
    import torch
    from torch.nn.utils import parametrize
    import nvfp4
    for layer in model.model.layers:
        ex = layer.mlp.experts
        for name, halves in (("gate_up_proj", 2), ("down_proj", 1)):
            if parametrize.is_parametrized(ex, name):
                parametrize.remove_parametrizations(ex, name, leave_parametrized=False)
                with torch.no_grad():
                    p = getattr(ex, name)
                    p.copy_(nvfp4.fake_quant_experts(p.data, halves))


def make_optimizer(model, lr):
    import torch
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "conv1d" not in n else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * t)))


def train_step(model, opt, ids, labels, lr, qat):
    import torch
    import torch.nn.functional as F
    from torch.nn.utils import parametrize
    for g in opt.param_groups:
        g["lr"] = lr
    ids = torch.from_numpy(ids).cuda(non_blocking=True)
    labels = torch.from_numpy(labels).cuda(non_blocking=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if qat:
            with parametrize.cached():
                out = model(input_ids=ids, output_router_logits=True, use_cache=False)
        else:
            out = model(input_ids=ids, output_router_logits=True, use_cache=False)
    logits = out.logits[:, :-1].float()
    tgt = labels[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
    aux = out.aux_loss if torch.is_tensor(out.aux_loss) else torch.zeros((), device=ce.device)
    loss = ce + model.config.router_aux_loss_coef * aux
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return ce, aux, gnorm


def new_model(cfg, experts_impl):
    import torch
    from transformers import Qwen3_5MoeForCausalLM
    torch.manual_seed(SEED)
    model = Qwen3_5MoeForCausalLM(cfg).cuda()
    if experts_impl != "eager":
        model.set_experts_implementation(experts_impl)
    model.train()
    return model


def pick_experts_impl(cfg, batcher):
    """grouped_mm runs all experts in one kernel; use it when it works here and agrees with eager."""
    import torch
    ids, labels = batcher.next()
    t_ids = torch.from_numpy(ids).cuda()
    results = {}
    for impl in ("eager", "grouped_mm"):
        try:
            model = new_model(cfg, impl)
            opt = make_optimizer(model, 1e-3)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                ref = model(input_ids=t_ids, use_cache=False).logits.float()
            for _ in range(3):
                train_step(model, opt, ids, labels, 1e-3, False)
            torch.cuda.synchronize()
            t = time.time()
            for _ in range(5):
                train_step(model, opt, ids, labels, 1e-3, False)
            torch.cuda.synchronize()
            results[impl] = ((time.time() - t) / 5, ref)
            log(f"experts implementation {impl}: {results[impl][0] * 1000:.1f} ms/step on a {ids.shape} batch")
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            log(f"experts implementation {impl} unusable: {type(e).__name__}: {e}")
    if "grouped_mm" in results:
        diff = (results["grouped_mm"][1] - results["eager"][1]).abs().max().item()
        scale = results["eager"][1].abs().max().item()
        log(f"grouped_mm vs eager initial logits: max |diff| {diff:.3g} (max |logit| {scale:.3g})")
        if diff <= 0.05 * scale and results["grouped_mm"][0] < results["eager"][0]:
            return "grouped_mm"
    return "eager"


# ----------------------------------------------------------------------------------------------
# Saving, checking, calibration


def save_model(model, tok, model_dir):
    import torch
    from safetensors import safe_open
    os.makedirs(model_dir, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.save_pretrained(model_dir)
    tokenizer_build.write_tokenizer(tok, model_dir)
    shutil.copyfile(gen_data.TEMPLATE_PATH, os.path.join(model_dir, "chat_template.jinja"))
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    gen_cfg = {"bos_token_id": None, "eos_token_id": [im_end, eot], "pad_token_id": eot,
               "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump(gen_cfg, f, indent=2)
        f.write("\n")
    # The checkpoint must be one BF16 safetensors file with the qwen3_5_moe names.
    path = os.path.join(model_dir, "model.safetensors")
    with safe_open(path, "pt") as f:
        names = sorted(f.keys())
        dtypes = {str(f.get_slice(n).get_dtype()) for n in names}
    log(f"saved {len(names)} tensors, dtypes {dtypes}, {os.path.getsize(path) / 1e6:.1f} MB")
    for n in names:
        if n.startswith("model.layers.0.") or not n.startswith("model.layers."):
            log(f"  {n}")
    required = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                "model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.A_log",
                "model.layers.3.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight",
                "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                "model.layers.0.mlp.shared_expert.gate_proj.weight", "model.layers.0.mlp.shared_expert_gate.weight"]
    missing = [n for n in required if n not in names]
    if missing or dtypes not in ({"BF16"}, {"torch.bfloat16"}):
        # Not fatal: kiln quantize reads fused and per-expert layouts; the log shows what was written.
        log(f"WARNING: unexpected checkpoint layout: missing {missing}, dtypes {dtypes}; names: {names[:40]}")
    return names


def calibrate(model_dir, texts_ids, out_path):
    """Activation amax at the input of every linear (and of each routed expert's gate/up and down
    projections) over teacher-forced conversations, for NVFP4 input_scale = amax / (6 * 448)."""
    import torch
    import eval as ev
    model = ev.load_model(model_dir)
    amax = {}
    state = {"valid": None}

    def upd(name, x):
        if x.numel():
            v = float(x.detach().abs().max())
            amax[name] = max(amax.get(name, 0.0), v)

    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_hook(
                lambda m, inp, out, name=name: upd(name, inp[0].reshape(-1, inp[0].shape[-1])[state["valid"]])))
        if name.endswith("mlp.experts"):
            def expert_hook(m, inp, out, name=name):
                hidden, top_idx = inp[0], inp[1]
                valid = state["valid"]
                for e in range(m.num_experts):
                    sel = (top_idx == e).any(-1) & valid
                    x = hidden[sel]
                    if not x.numel():
                        continue
                    gate, up = torch.nn.functional.linear(x, m.gate_up_proj[e]).chunk(2, dim=-1)
                    h = m.act_fn(gate) * up
                    upd(f"{name}.{e}.gate_proj", x)
                    upd(f"{name}.{e}.up_proj", x)
                    upd(f"{name}.{e}.down_proj", h)
            hooks.append(mod.register_forward_hook(expert_hook))
    with torch.no_grad():
        for start in range(0, len(texts_ids), 64):
            batch = texts_ids[start:start + 64]
            width = max(len(t) for t in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            valid = torch.zeros((len(batch), width), dtype=torch.bool)
            for r, t in enumerate(batch):
                ids[r, :len(t)] = torch.tensor(t)
                valid[r, :len(t)] = True
            state["valid"] = valid.reshape(-1).cuda()
            model(input_ids=ids.cuda(), use_cache=False)
    for h in hooks:
        h.remove()
    doc = {"format": "kiln-calibration-amax/1",
           "description": "max |activation| at the input of each linear over teacher-forced kiln-tiny "
                          "conversations (transformers, BF16 weights, fp32 compute); input_scale = amax / (6*448)",
           "conversations": len(texts_ids), "amax": dict(sorted(amax.items()))}
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    log(f"calibration: {len(amax)} activation ranges from {len(texts_ids)} conversations -> {out_path}")


def sample_texts(tok, n, seed):
    convs = gen_data.generate(seed, n, "mix")
    out = []
    for c in convs:
        p, comp = gen_data.render_example(c)
        out.append(tok.encode(p, add_special_tokens=False).ids + tok.encode(comp, add_special_tokens=False).ids)
    return out


# ----------------------------------------------------------------------------------------------


def run(args):
    import numpy as np
    os.makedirs(args.out, exist_ok=True)
    random.seed(SEED)
    np.random.seed(SEED)

    # 1. tokenizer
    sample = gen_data.generate(7, args.tokenizer_convs, "mix")
    texts = [p + c for p, c in (gen_data.render_example(x) for x in sample)]
    tok = tokenizer_build.train_tokenizer(texts, BPE_VOCAB)
    base = tok.get_vocab_size(with_added_tokens=False)
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    vocab_size = (n_vocab + 63) // 64 * 64
    pad_id, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    log(f"tokenizer: {base} BPE tokens + {n_vocab - base} added = {n_vocab}; model vocab {vocab_size}")
    ex = gen_data.render_example(sample[0])
    enc = tok.encode(ex[0] + ex[1], add_special_tokens=False)
    log(f"example: {len(enc.ids)} tokens: {enc.tokens[:60]}")
    assert tok.decode(enc.ids, skip_special_tokens=False) == ex[0] + ex[1], "decode(encode(x)) != x"
    # Jinja cross-check of the fast renderer on a slice of the tokenizer sample.
    for conv in sample[:2000]:
        gen_data.check_against_jinja(conv)
    log("renderer matches jinja2 on 2000 conversations")

    # 2. corpus
    corpus = build_corpus(tok, args.conversations, 25_000, args.workers)
    lens, plens, tags = corpus["lens"], corpus["plens"], corpus["tags"]
    n_target = int((lens - plens).sum())
    log(f"corpus: {len(lens)} conversations, {int(lens.sum())} tokens ({n_target} trained), "
        f"max length {int(lens.max())}, mean {lens.mean():.1f}")
    max_completion = {}
    for s, name in enumerate(gen_data.SKILLS):
        for th in (0, 1):
            sel = tags == s * 2 + th
            if sel.any():
                cl = lens[sel] - plens[sel]
                max_completion[(name, th)] = int(cl.max())
                log(f"  {name:6} {'think ' if th else 'direct'} {int(sel.sum()):8d} convs, completion mean "
                    f"{cl.mean():6.1f} max {int(cl.max())}")
    max_new_think = max(v for (s, th), v in max_completion.items() if th) + 64
    max_new_direct = max(v for (s, th), v in max_completion.items() if not th) + 32

    import torch
    import eval as ev
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    cfg = make_config(vocab_size, pad_id, im_end)
    batcher = Batcher(corpus, args.tokens_per_step, pad_id, SEED)

    # 3. smoke test of every code path
    impl = pick_experts_impl(cfg, batcher)
    log(f"using experts implementation: {impl}")
    model = new_model(cfg, impl)
    total, experts, active = count_params(model)
    log(f"model: {total / 1e6:.2f}M parameters ({experts / 1e6:.2f}M in routed experts), "
        f"{active / 1e6:.2f}M active per token")
    opt = make_optimizer(model, args.lr)
    for s in range(4):
        if s == 2:
            enable_qat(model)
        ids, labels = batcher.next()
        ce, aux, gn = train_step(model, opt, ids, labels, args.lr * 0.1, s >= 2)
        log(f"smoke step {s}: ce {ce.item():.3f} aux {aux.item():.3f} gnorm {gn.item():.2f}")
    bake_qat(model)
    smoke_dir = os.path.join(args.work, "smoke_model")
    save_model(model, tok, smoke_dir)
    items = ev.build_items(6)
    ev.run_eval(smoke_dir, items, 24, 12, log=log)
    try:
        ev.check_hf_tokenizer(smoke_dir, items, log=log)
    except Exception:  # noqa: BLE001 - informative only
        log("hf tokenizer check failed:\n" + traceback.format_exc())
    calibrate(smoke_dir, sample_texts(tok, 8, 99), os.path.join(args.work, "smoke_calib.json"))
    del model, opt
    torch.cuda.empty_cache()
    log("smoke test passed")
    if args.smoke_only:
        return

    # 4. training
    model = new_model(cfg, impl)
    opt = make_optimizer(model, args.lr)
    curve = []
    t_train = time.time()
    total_steps, qat_start, qat_on = None, None, False
    step, tok_seen, t_mark, last = 0, 0, None, time.time()
    ce_acc, aux_acc, n_acc = 0.0, 0.0, 0
    while True:
        if step == 10:
            torch.cuda.synchronize()
            t_mark = time.time()
        if step == 40:
            torch.cuda.synchronize()
            dt = (time.time() - t_mark) / 30
            remaining = args.train_seconds - (time.time() - t_train)
            total_steps = step + max(10, int(remaining / dt))
            qat_start = int(total_steps * (1 - QAT_FRACTION))
            log(f"step time {dt * 1000:.1f} ms -> {total_steps} steps (QAT from step {qat_start})")
        if qat_start is not None and step >= qat_start and not qat_on:
            enable_qat(model)
            qat_on = True
            torch.cuda.synchronize()
            log(f"step {step}: QAT on (NVFP4 round trip of routed experts, straight-through)")
        lr = lr_at(step, total_steps or 10**9, args.lr, args.warmup)
        ids, labels = batcher.next()
        ce, aux, gn = train_step(model, opt, ids, labels, lr, qat_on)
        tok_seen += ids.size
        step += 1
        if step % 25 == 0:
            ce_acc += ce.item()
            aux_acc += aux.item()
            n_acc += 1
        if step % args.log_every == 0:
            now = time.time()
            rate = tok_seen / (now - t_train)
            row = {"step": step, "lr": lr, "ce": ce_acc / max(1, n_acc), "aux": aux_acc / max(1, n_acc),
                   "gnorm": float(gn), "elapsed_s": round(now - t_train, 1), "tokens": tok_seen,
                   "epoch": batcher.epoch, "qat": qat_on}
            curve.append(row)
            log(f"step {step:5d}/{total_steps} lr {lr:.2e} ce {row['ce']:.4f} aux {row['aux']:.3f} "
                f"gnorm {row['gnorm']:.2f} {rate / 1e3:.0f}k tok/s epoch {batcher.epoch}{' QAT' if qat_on else ''}")
            ce_acc, aux_acc, n_acc = 0.0, 0.0, 0
            last = now
        if total_steps is not None and step >= total_steps:
            break
        if time.time() - t_train > args.train_seconds * 1.1:
            log("time budget exceeded: stopping early")
            break
    train_time = time.time() - t_train
    log(f"trained {step} steps, {tok_seen / 1e6:.1f}M tokens (padded) in {train_time:.0f}s")
    bake_qat(model)
    model.eval()

    # 5. save, archive, evaluate, calibrate
    model_dir = os.path.join(args.out, "model")
    save_model(model, tok, model_dir)
    del model, opt
    torch.cuda.empty_cache()
    meta = {"arch": ARCH, "rope": ROPE, "bpe_vocab": base, "model_vocab": vocab_size, "seed": SEED,
            "steps": step, "train_seconds": round(train_time, 1), "tokens_padded": tok_seen,
            "tokens_per_step": args.tokens_per_step, "lr": args.lr, "warmup": args.warmup,
            "qat_fraction": QAT_FRACTION, "qat_start": qat_start, "experts_implementation": impl,
            "conversations": int(len(lens)), "corpus_tokens": int(lens.sum()), "trained_tokens": n_target,
            "params_total": total, "params_routed_experts": experts, "params_active": active,
            "curve": curve}
    with open(os.path.join(args.out, "train_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    if args.archive:
        args.archive()
    deadline = T0 + args.total_seconds
    items = ev.build_items(args.eval_per_mode)
    summaries = ev.run_eval(model_dir, items, max_new_think, max_new_direct, deadline=deadline, log=log)
    ev.write_json(os.path.join(args.out, "eval_prompts.json"), items, summaries)
    try:
        ev.check_hf_tokenizer(model_dir, items[:100] + items[-100:], log=log)
    except Exception:  # noqa: BLE001 - informative only
        log("hf tokenizer check failed:\n" + traceback.format_exc())
    try:
        calibrate(model_dir, sample_texts(tok, 512, 4242), os.path.join(args.out, "calib_amax.json"))
    except Exception:  # noqa: BLE001 - the model and eval are already saved
        log("calibration failed:\n" + traceback.format_exc())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/kiln_tiny_work")
    ap.add_argument("--train-seconds", type=float, default=270)
    ap.add_argument("--total-seconds", type=float, default=540, help="deadline for the whole script (eval stops)")
    ap.add_argument("--conversations", type=int, default=1_200_000)
    ap.add_argument("--tokenizer-convs", type=int, default=100_000)
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--eval-per-mode", type=int, default=300)
    ap.add_argument("--smoke-only", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)

    def archive():
        # Tar the model + logs into OUT as soon as they exist (eval may still fail afterwards).
        out = os.environ.get("OUT")
        if out:
            os.system(f"tar -C {args.out} -czf - model train_meta.json | split -b 15000000 - {out}/kt.tgz.part-")
            log(f"archived model to {out}/kt.tgz.part-*")

    args.archive = archive
    try:
        run(args)
    except Exception:
        log("FAILED:\n" + traceback.format_exc())
        sys.exit(1)
    log("done")


if __name__ == "__main__":
    main()
