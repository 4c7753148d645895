#!/usr/bin/env python3
"""Trains a multi-token-prediction (MTP) head for kiln-tiny, the main model frozen, and writes the model folder with it.

  PYTHONUNBUFFERED=1 python3 tools/tiny/train_mtp.py --model models/kiln-tiny --out OUTDIR [--train-seconds 240]

Needs torch, transformers (5.x), tokenizers, safetensors, numpy and a GPU (a few minutes on one H100). Writes
OUTDIR/model/ (a copy of --model with the mtp.* tensors added to model.safetensors, config.json's
mtp_num_hidden_layers = 1 and "mtp*" in hf_quant_config.json's exclude list: the head is stored BF16) and
OUTDIR/train_mtp_meta.json (settings, loss curve, measured acceptance). Copy OUTDIR/model/* over models/kiln-tiny/
to ship it.

The head (Qwen3.5 layout, the same maths as src/model/mtp.h and tools/reference/make_fixtures.py's MtpHead):
    entry j = (t[j+1], h[j]):  x_j = fc([pre_fc_norm_embedding(embed(t[j+1])) | pre_fc_norm_hidden(h[j])])
    g_j = mtp.norm(layer(x_0 .. x_j)),  logits_j = lm_head(g_j) predicts t[j+2]
h is the frozen target's last hidden state after its final norm (what vLLM / SGLang hand the drafter); embedding and
lm_head are the target's, frozen. The layer is transformers' own Qwen3.5-MoE full-attention decoder layer, started
from a copy of the target's last full-attention layer; fc starts as [0 | I] (the head first sees the target's
hidden state), the pre-fc norms at 0 (zero-centred: weight 1), mtp.norm as the target's final norm.

Data: tools/tiny/gen_data.py's conversations (the first stage's mix gen_data.MIX, fresh seeds), the loss on every
non-padding position (the head predicts whatever the target reads: prompts and completions).

Acceptance: on held-out conversations the target's greedy continuation is generated, then at sampled positions the
head's greedy chain of K drafts (K = 1 .. --max-k) is compared with the continuation: accept length = matched
drafts + 1 (the verify pass's own token), the number kiln's greedy speculative decoding gets per verify step.
"""
import argparse
import json
import math
import os
import random
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_data  # noqa: E402

T0 = time.time()
SEED = 2828
CORPUS_SEED_BASE = 3_000_000  # the earlier stages used 1_000_000 / 2_000_000 + chunk


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def make_corpus(tok, n, seed):
    """Right-padded token rows of n conversations (gen_data.MIX), as a list of id lists."""
    rng = random.Random(seed)
    convs = []
    for _ in range(n):
        thinking = rng.random() < 0.5
        mix = gen_data.MIX[thinking]
        skill = rng.choices(list(mix), weights=list(mix.values()))[0]
        convs.append(gen_data.make_conversation(rng, thinking, skill))
    rendered = [gen_data.render_example(c) for c in convs]
    enc_p = tok.encode_batch([p for p, _ in rendered], add_special_tokens=False)
    enc_c = tok.encode_batch([c for _, c in rendered], add_special_tokens=False)
    return [(p.ids + c.ids, len(p.ids)) for p, c in zip(enc_p, enc_c)]


def build_head(target, cfg):
    import torch
    from torch import nn

    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    layer_idx = full[-1]

    class MtpHead(nn.Module):
        def __init__(self):
            super().__init__()
            hidden = cfg.hidden_size
            norm_cls = type(target.model.norm)
            self.fc = nn.Linear(2 * hidden, hidden, bias=False)
            self.pre_fc_norm_embedding = norm_cls(hidden, eps=cfg.rms_norm_eps)
            self.pre_fc_norm_hidden = norm_cls(hidden, eps=cfg.rms_norm_eps)
            self.layers = nn.ModuleList([type(target.model.layers[layer_idx])(cfg, layer_idx)])
            self.norm = norm_cls(hidden, eps=cfg.rms_norm_eps)

    head = MtpHead()
    with torch.no_grad():
        head.layers[0].load_state_dict(target.model.layers[layer_idx].state_dict())
        head.norm.load_state_dict(target.model.norm.state_dict())
        for n in (head.pre_fc_norm_embedding, head.pre_fc_norm_hidden):
            n.weight.zero_()
        h = cfg.hidden_size
        w = torch.zeros(h, 2 * h)
        w[:, h:] = torch.eye(h)
        w[:, :h] = torch.randn(h, h) * (0.02 / math.sqrt(h))
        head.fc.weight.copy_(w)
    return head, layer_idx


class TargetRun:
    """The frozen target over ids [B, T]: its final-norm hidden states and the keyword arguments (rotary
    embeddings, mask, positions) its full-attention layer `layer_idx` received, which the MTP layer reuses."""

    def __init__(self, target, layer_idx):
        self.target, self.layer_idx = target, layer_idx

    def __call__(self, ids, attention_mask=None):
        import torch
        captured = {}

        def grab(mod, args, kwargs):
            captured.update(kwargs)

        hook = self.target.model.layers[self.layer_idx].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.no_grad():
                hidden = self.target.model(input_ids=ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        finally:
            hook.remove()
        kwargs = {k: v for k, v in captured.items()
                  if k not in ("hidden_states", "past_key_values", "past_key_value", "use_cache")}
        return hidden, kwargs


def head_forward(head, target, entry_ids, hidden, layer_kwargs):
    """g [B, T, H] for entries (entry_ids[:, j], hidden[:, j])."""
    import torch
    emb = target.model.embed_tokens(entry_ids)
    x = head.fc(torch.cat([head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(hidden)], dim=-1))
    out = head.layers[0](x, **layer_kwargs)
    if isinstance(out, tuple):
        out = out[0]
    return head.norm(out)


def batches(corpus, batch_tokens, rng, pad_id):
    import torch
    order = list(range(len(corpus)))
    while True:
        rng.shuffle(order)
        i = 0
        while i < len(order):
            rows, width = [], 0
            while i < len(order):
                ids, _ = corpus[order[i]]
                w = max(width, len(ids))
                if rows and w * (len(rows) + 1) > batch_tokens:
                    break
                rows.append(ids)
                width = w
                i += 1
            t = torch.full((len(rows), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, ids in enumerate(rows):
                t[r, :len(ids)] = torch.tensor(ids)
                mask[r, :len(ids)] = 1
            yield t, mask


def train(head, target, run, corpus, args, pad_id):
    import torch
    import torch.nn.functional as F
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(SEED)
    it = batches(corpus, args.batch_tokens, rng, pad_id)
    curve, step, start = [], 0, time.time()
    while True:
        frac = (time.time() - start) / args.train_seconds
        if frac >= 1.0:
            break
        lr = args.lr * (min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, mask = next(it)
        ids, mask = ids.cuda(), mask.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden, kw = run(ids, mask)
            # entry j = (t[j+1], h[j]) predicts t[j+2]: entries j = 0 .. T-3 have a label.
            n = ids.shape[1] - 1
            if args.chain_steps == 1:
                gs = [head_forward(head, target, ids[:, 1:], hidden[:, :-1], shift_kwargs(kw, n))]
            else:
                gs = chain_forward(head, target, ids[:, 1:], hidden[:, :-1], shift_kwargs(kw, n), args.chain_steps)
            logits = [target.lm_head(g[:, :-1]).float() for g in gs]
        labels = ids[:, 2:].masked_fill(mask[:, 2:] == 0, -100)
        losses = []
        for s, lg in enumerate(logits):
            # Step s + 1 at entry j reads step s's output at entry j - 1: entries j < s have no such input.
            lab = labels.clone()
            lab[:, :s] = -100
            losses.append(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab.reshape(-1), ignore_index=-100))
        loss = sum(losses) / len(losses)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0:
            point = {"step": step, "seconds": round(time.time() - start, 1), "loss": round(loss.item(), 4), "lr": lr}
            if len(losses) > 1:
                point["loss_per_chain_step"] = [round(x.item(), 4) for x in losses]
            curve.append(point)
            log(f"step {step:6d} loss {loss.item():.4f} {point.get('loss_per_chain_step', '')} lr {lr:.2e}")
        step += 1
    return curve, step


def shift_kwargs(kw, n):
    """The layer's keyword arguments cut to the first n positions (entries j = 0 .. n-1 run at positions j)."""
    import torch
    out = {}
    for k, v in kw.items():
        if k == "position_embeddings" and isinstance(v, tuple):
            out[k] = tuple(t[..., :n, :] for t in v)
        elif k == "attention_mask" and torch.is_tensor(v) and v.dim() == 4:
            out[k] = v[..., :n, :n]
        elif k in ("position_ids", "cache_position") and torch.is_tensor(v):
            out[k] = v[..., :n]
        else:
            out[k] = v
    return out


def chain_mask(steps, n, device, impl):
    """The attention mask of `steps` chain steps of n entries each, concatenated along the sequence (step-major).

    At inference the MTP layer's cache holds step-1 entries (the target's hidden states) for every verified position;
    a chain that starts after pending token t[i] adds its step-2 entry at position i, its step-3 entry at i + 1, ...
    So the step-s entry at position j sees the step-1 entries at positions <= j - s + 1, the step-r entry (2 <= r < s)
    at position j - (s - r), and itself. Every row allows at least itself."""
    import torch
    j = torch.arange(n, device=device)
    q, p = j[:, None], j[None, :]
    allowed = torch.zeros(steps * n, steps * n, dtype=torch.bool, device=device)
    for s in range(1, steps + 1):
        for r in range(1, s + 1):
            block = (p <= q - s + 1) if r == 1 else (p == q - (s - r))
            allowed[(s - 1) * n:s * n, (r - 1) * n:r * n] = block
    allowed = allowed[None, None]
    if impl == "sdpa":
        return allowed  # True: attend
    if impl == "eager":
        return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)
    raise ValueError(f"--chain-steps > 1 needs the sdpa or eager attention, not {impl}")


def concat_forward(head, target, entry_ids, hiddens, layer_kwargs):
    """The head over len(hiddens) chain steps at once (step s's entries: (entry_ids[:, j], hiddens[s][:, j])), with
    chain_mask's attention; returns each step's g [B, n, H]."""
    import torch
    steps, n = len(hiddens), entry_ids.shape[1]
    e = head.pre_fc_norm_embedding(target.model.embed_tokens(entry_ids))
    x = torch.cat([head.fc(torch.cat([e, head.pre_fc_norm_hidden(h)], dim=-1)) for h in hiddens], dim=1)
    kw = {}
    for k, v in layer_kwargs.items():
        if k == "attention_mask":
            continue
        if k == "position_embeddings" and isinstance(v, tuple):
            kw[k] = tuple(torch.cat([t] * steps, dim=-2) for t in v)  # entry j of every step runs at position j
        elif k in ("position_ids", "cache_position") and torch.is_tensor(v):
            kw[k] = torch.cat([v] * steps, dim=-1)
        else:
            kw[k] = v
    kw["attention_mask"] = chain_mask(steps, n, x.device, target.config._attn_implementation)
    out = head.layers[0](x, **kw)
    if isinstance(out, tuple):
        out = out[0]
    return list(head.norm(out).split(n, dim=1))


def chain_forward(head, target, entry_ids, hidden, layer_kwargs, steps):
    """Training-time chains: step 1 reads the target's hidden states; step s + 1 at entry j reads step s's output at
    entry j - 1 (what the draft chain feeds back), computed without gradient, then all steps in one pass."""
    import torch
    hiddens = [hidden]
    with torch.no_grad():
        for _ in range(1, steps):
            g = concat_forward(head, target, entry_ids, hiddens, layer_kwargs)[-1]
            hiddens.append(torch.cat([hidden[:, :1], g[:, :-1].to(hidden.dtype)], dim=1).detach())  # entry 0: no input (no label)
    return concat_forward(head, target, entry_ids, hiddens, layer_kwargs)


def chain(head, target, run, prefix, pending, k):
    """The head's greedy chain of k drafts after `prefix` (run by the target) with the pending token."""
    import torch
    ids = torch.tensor([prefix + [pending]], dtype=torch.long).cuda()
    hidden, _ = run(ids[:, :-1])
    entry_tokens = ids[:, 1:]          # t[j+1] for j = 0 .. L-1
    hs = hidden                        # h[j]
    drafts = []
    for _ in range(k):
        n = entry_tokens.shape[1]
        _, kw = run(torch.zeros((1, n), dtype=torch.long).cuda())
        g = head_forward(head, target, entry_tokens, hs, kw)
        d = int(torch.argmax(target.lm_head(g[0, -1])))
        drafts.append(d)
        entry_tokens = torch.cat([entry_tokens, torch.tensor([[d]]).cuda()], dim=1)
        hs = torch.cat([hs, g[:, -1:]], dim=1)
    return drafts


def measure_acceptance(head, target, run, tok, args, pad_id, eos_ids):
    import torch
    rng = random.Random(SEED + 1)
    convs = make_corpus(tok, args.eval_conversations, CORPUS_SEED_BASE + 999)
    accept = {k: [] for k in range(1, args.max_k + 1)}
    head.eval()
    with torch.no_grad():
        for ids, plen in convs:
            prompt = ids[:plen]
            out = target.generate(torch.tensor([prompt]).cuda(), max_new_tokens=args.eval_new_tokens,
                                  do_sample=False, eos_token_id=eos_ids, pad_token_id=pad_id)
            seq = out[0].tolist()
            cont = len(seq) - plen
            if cont < 3:
                continue
            for i in sorted(rng.sample(range(plen, len(seq) - 1), min(args.eval_positions, cont - 1))):
                # Position i's token seq[i] is pending (sampled, not yet run); the chain guesses seq[i+1 ..].
                drafts = chain(head, target, run, seq[:i], seq[i], args.max_k)
                for k in range(1, args.max_k + 1):
                    m = 0
                    while m < k and i + 1 + m < len(seq) and drafts[m] == seq[i + 1 + m]:
                        m += 1
                    accept[k].append(m + 1)
    return {k: (sum(v) / len(v) if v else None) for k, v in accept.items()}, sum(len(v) for v in accept.values()) // args.max_k


def write_model(head, src_dir, out_dir):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(src_dir):
        if name not in ("model.safetensors", "config.json", "hf_quant_config.json"):
            shutil.copyfile(os.path.join(src_dir, name), os.path.join(out_dir, name))
    tensors = {}
    with safe_open(os.path.join(src_dir, "model.safetensors"), "pt") as f:
        meta = f.metadata() or {"format": "pt"}
        for k in f.keys():
            if not k.startswith("mtp."):
                tensors[k] = f.get_tensor(k)
    for k, v in head.state_dict().items():
        tensors["mtp." + k] = v.detach().to(torch.bfloat16).cpu().contiguous()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata=meta)
    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    (cfg["text_config"] if "text_config" in cfg else cfg)["mtp_num_hidden_layers"] = 1
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    qpath = os.path.join(src_dir, "hf_quant_config.json")
    if os.path.exists(qpath):
        with open(qpath) as f:
            q = json.load(f)
        ex = q["quantization"].setdefault("exclude_modules", [])
        if "mtp*" not in ex:
            ex.append("mtp*")  # the head is stored BF16
        with open(os.path.join(out_dir, "hf_quant_config.json"), "w") as f:
            json.dump(q, f, indent=4)
            f.write("\n")
    n_mtp = sum(1 for k in tensors if k.startswith("mtp."))
    mtp_bytes = sum(v.numel() * v.element_size() for k, v in tensors.items() if k.startswith("mtp."))
    log(f"wrote {out_dir}: {len(tensors)} tensors ({n_mtp} mtp.*, {mtp_bytes / 1e6:.2f} MB)")
    return n_mtp, mtp_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(HERE, "..", "..", "models", "kiln-tiny"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--train-seconds", type=float, default=240)
    ap.add_argument("--conversations", type=int, default=120_000)
    ap.add_argument("--batch-tokens", type=int, default=32_768)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--chain-steps", type=int, default=1,
                    help="train the head on chains of this many steps: step s + 1 reads step s's output as its "
                         "hidden state, as the draft chain does (1: the target's hidden state only)")
    ap.add_argument("--resume", action="store_true",
                    help="start from the mtp.* head --model already holds (else a fresh head from the last layer)")
    ap.add_argument("--skip-eval-before", action="store_true",
                    help="skip measuring the untrained head's acceptance (the reference delta rule makes it slow)")
    ap.add_argument("--eval-conversations", type=int, default=60)
    ap.add_argument("--eval-positions", type=int, default=8, help="chain starts per held-out conversation")
    ap.add_argument("--eval-new-tokens", type=int, default=96)
    args = ap.parse_args()

    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3_5MoeTextConfig
    import continue_train as ct
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    torch.backends.cuda.matmul.allow_tf32 = True
    os.makedirs(args.out, exist_ok=True)

    with open(os.path.join(args.model, "tokenizer.json"), encoding="utf-8") as f:
        tok = Tokenizer.from_str(f.read())
    pad_id = tok.token_to_id("<|endoftext|>")
    eos_ids = [i for i in (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")) if i is not None]
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")

    # The frozen target: the shipped weights (NVFP4 experts dequantised exactly, continue_train's loader).
    cfg = Qwen3_5MoeTextConfig.from_pretrained(args.model)
    state = ct.load_shipped_state(args.model, cfg.num_hidden_layers, cfg.num_experts)
    target = ct.build_model(cfg, state, "eager")
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    head, layer_idx = build_head(target, cfg)
    if args.resume:
        from safetensors.torch import load_file
        shipped = {k[4:]: v.float() for k, v in load_file(os.path.join(args.model, "model.safetensors")).items()
                   if k.startswith("mtp.")}
        if not shipped:
            raise ValueError(f"--resume: {args.model} has no mtp.* tensors")
        head.load_state_dict(shipped)  # strict: every tensor of the head, nothing else
        log(f"resumed from the {len(shipped)} mtp.* tensors of {args.model}")
    head = head.cuda().float().train()
    run = TargetRun(target, layer_idx)
    log(f"head: {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters (layer from target layer {layer_idx})")

    corpus = make_corpus(tok, args.conversations, CORPUS_SEED_BASE)
    log(f"corpus: {len(corpus)} conversations, {sum(len(c[0]) for c in corpus)} tokens")

    before = None
    if not args.skip_eval_before:
        before, _ = measure_acceptance(head, target, run, tok, args, pad_id, eos_ids)
        log(f"acceptance before training (K: mean accept length): {before}")
    head.train()
    curve, steps = train(head, target, run, corpus, args, pad_id)
    n_mtp, mtp_bytes = write_model(head, args.model, os.path.join(args.out, "model"))
    log(f"wrote {n_mtp} mtp tensors ({mtp_bytes} bytes) to {os.path.join(args.out, 'model')}")
    after, n_chains = measure_acceptance(head, target, run, tok, args, pad_id, eos_ids)
    log(f"acceptance after {steps} steps (K: mean accept length over {n_chains} chains): {after}")
    meta = {"script": "tools/tiny/train_mtp.py", "seed": SEED, "args": vars(args), "steps": steps,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
            "loss_curve": curve, "accept_length_before": before, "accept_length_after": after,
            "accept_chains": n_chains, "mtp_tensors": n_mtp, "mtp_bytes": mtp_bytes,
            "hidden_state": "target's last hidden state after the final norm; chain steps feed mtp.norm's output"}
    with open(os.path.join(args.out, "train_mtp_meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    log("done")


if __name__ == "__main__":
    main()
