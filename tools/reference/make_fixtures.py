#!/usr/bin/env python3
"""Creates kiln's reference fixtures: tiny random-weight checkpoints of every supported model family and the
logits Hugging Face transformers computes for them.

Run it where torch + transformers (5.17) + safetensors are installed (not needed for building kiln):

    PYTHONUNBUFFERED=1 python3 tools/reference/make_fixtures.py --out tests/fixtures/reference

For each fixture <family>_<variant> it writes
    <out>/<name>/model/config.json, [generation_config.json], [hf_quant_config.json], model.safetensors
    <out>/<name>/expected.safetensors   reference tokens and logits (see below)
    <out>/<name>/manifest.json          script version, library versions, prompts, self-checks

Reference computation (the choice that the C++ tests' tolerances rely on):
  * transformers runs the model in float32 on the CPU (eager attention, the torch fallback paths for the
    causal conv and the gated delta rule: no fla / causal_conv1d kernels), with weights that are exactly
    the checkpoint's values: BF16 weights upcast, NVFP4 / FP8 weights dequantised in fp32 by nvfp4.py
    (REFERENCE section 2). So the reference is the model's maths on the stored weights without any
    bf16 rounding of activations; kiln's CPU backend computes in fp32 too, so differences are
    accumulation-order noise (and KV-cache rounding when kiln stores the cache in BF16 / FP8).
  * Each prompt (random token ids) runs alone (batch 1, no padding): a batch with left padding would
    shift positions and mask the linear-attention inputs; kiln's batch test compares a mixed batch with
    these single-sequence references instead.
  * Prefill logits: every position for short prompts, the last 8 positions for long ones.
  * Greedy decode: step 0 is the argmax of the prefill's last logits; step s >= 1 feeds token s-1
    through the KV / recurrent cache (transformers' decode path: causal_conv1d_update and the recurrent
    gated delta rule). All step logits are stored.
  * For the BF16 fixtures, the prefill's last-position logits of the same model run in bfloat16 are stored
    too (information only: how far a bf16 engine is from the fp32 maths).

expected.safetensors, per prompt i:
    p{i}.tokens            I32 [L]
    p{i}.prefill_logits    F32 [R, V]   positions L-R .. L-1 (manifest: prefill_first_pos)
    p{i}.greedy_tokens     I32 [S]
    p{i}.greedy_logits     F32 [S, V]   row s chose greedy_tokens[s] (row 0 = prefill's last position)
    p{i}.prefill_last_logits_bf16  F32 [V]   (BF16 fixtures only)

The MTP fixture (qwen3_5_moe_mtp: the qwen3_5_moe BF16 model plus a random multi-token-prediction head, config.json
text_config.mtp_num_hidden_layers = 1, tensors mtp.*) adds, per prompt i:
    p{i}.next_token        I32 [1]      argmax of the prefill's last logits (the pending token the chain starts from)
    p{i}.draft_tokens      I32 [K]      the head's greedy chain (K = manifest draft_steps)
    p{i}.draft_logits      F32 [K, V]   its logits per step
    p{i}.target_hidden     F32 [L, H]   the target's hidden state per prompt position (the head's h[j], see below)
transformers has no MTP module for Qwen3.5 (its loaders drop mtp.*), so MtpHead below builds one from transformers'
own decoder layer class (Qwen3_5MoeDecoderLayer, a full-attention layer built as layer 3 of the same config) and
RMSNorm class, plus the fc and the two pre-fc norms, following vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py and
SGLang's qwen3_5_mtp.py:
    entry j = (t[j+1], h[j]):  x_j = fc(cat(pre_fc_norm_embedding(embed(t[j+1])), pre_fc_norm_hidden(h[j])))
    (the embedding first), the MTP layer over x_0 .. x_j at positions 0 .. j (causal), then mtp.norm and the
    shared lm_head give the logits of t[j+2]. A chain step k >= 2 uses (d_{k-1}, g_{k-1}) with g the previous
    step's mtp.norm output.
Which hidden state h[j]: the target model's last hidden state AFTER its final norm (the input of lm_head). Both peers
hand the drafter their model's forward output, and both models' forward ends with the final norm: vLLM's
Qwen3NextModel.forward returns `self.norm(hidden_states, residual)` and its EAGLE/MTP proposer passes that output as
the draft model's hidden_states; SGLang's Qwen3_5ForCausalLM model forward applies `self.norm` before the logits
processor, which stores the hidden states it was given (capture_hidden_mode) as spec_info.hidden_states for the
draft. The chained g is likewise the head's output after mtp.norm (vLLM's predictor returns self.norm(...)). This
script takes h from model.model(...).last_hidden_state (after the final norm) and checks lm_head(h) against the
model's own logits. The head runs without a cache (the whole entry sequence each step), so the chain's reference
does not depend on transformers' cache classes.
"""
import argparse
import copy
import json
import os
import sys
import traceback

SCRIPT_VERSION = 1

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nvfp4  # noqa: E402

VOCAB = 512
PROMPT_LENGTHS = [1, 6, 33, 90]  # 90 > 64: two chunks in transformers' chunked gated delta rule
ALL_POSITIONS_MAX_LEN = 40
LONG_PROMPT_ROWS = 8
GREEDY_STEPS = 24

HYBRID_LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # 2 value heads per key head: exercises the head repeat
    linear_key_head_dim=16,
    linear_value_head_dim=32,  # != key head dim: catches k/v dimension mix-ups
    linear_conv_kernel_dim=4,
)
HYBRID_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]

FAMILIES = {
    "qwen3_5_moe": dict(
        config_class="Qwen3_5MoeTextConfig",
        model_class="Qwen3_5MoeForCausalLM",
        composite_config_class="Qwen3_5MoeConfig",
        architecture="Qwen3_5MoeForConditionalGeneration",
        prefix="model.language_model.",
        expert_layout="fused",
        zero_centred=True,
        seed=1001,
        config=dict(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, rms_norm_eps=1e-6, max_position_embeddings=4096,
            layer_types=HYBRID_LAYERS, tie_word_embeddings=False, eos_token_id=511,
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True),
            **HYBRID_LINEAR),
        variants=["bf16", "nvfp4", "nvfp4all", "mixed", "mtp"],
    ),
    "qwen3_5": dict(
        config_class="Qwen3_5TextConfig",
        model_class="Qwen3_5ForCausalLM",
        composite_config_class="Qwen3_5Config",
        architecture="Qwen3_5ForConditionalGeneration",
        prefix="model.language_model.",
        expert_layout=None,
        zero_centred=True,
        seed=1002,
        config=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=4096,
            layer_types=HYBRID_LAYERS, tie_word_embeddings=False, eos_token_id=511,
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True),
            **HYBRID_LINEAR),
        variants=["bf16"],
    ),
    "qwen3_next": dict(
        config_class="Qwen3NextConfig",
        model_class="Qwen3NextForCausalLM",
        architecture="Qwen3NextForCausalLM",
        prefix="model.",
        expert_layout="per_expert",
        zero_centred=True,
        seed=1003,
        config=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            rms_norm_eps=1e-6, max_position_embeddings=4096, layer_types=HYBRID_LAYERS,
            tie_word_embeddings=False, eos_token_id=511,
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
            **HYBRID_LINEAR),
        variants=["bf16", "nvfp4", "nvfp4all"],
    ),
    "qwen3_moe": dict(
        config_class="Qwen3MoeConfig",
        model_class="Qwen3MoeForCausalLM",
        architecture="Qwen3MoeForCausalLM",
        prefix="model.",
        expert_layout="per_expert",
        zero_centred=False,
        seed=1004,
        config=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], rms_norm_eps=1e-6,
            max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=511,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
        variants=["bf16", "nvfp4", "nvfp4all"],
    ),
    "qwen3": dict(
        config_class="Qwen3Config",
        model_class="Qwen3ForCausalLM",
        architecture="Qwen3ForCausalLM",
        prefix="model.",
        expert_layout=None,
        zero_centred=False,
        seed=1005,
        config=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=4096,
            tie_word_embeddings=True, eos_token_id=511,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
        variants=["bf16"],
    ),
}

GENERATION_EOS = [510, 511]

MTP_DRAFT_STEPS = 3
MTP_SEED_OFFSET = 28


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------------
# Model construction and random weights

def build_model(fam):
    import transformers
    cfg_cls = getattr(transformers, fam["config_class"])
    model_cls = getattr(transformers, fam["model_class"])
    cfg = cfg_cls(**fam["config"])
    try:
        cfg._attn_implementation = "eager"
    except Exception:
        pass
    torch.manual_seed(fam["seed"])
    model = model_cls(cfg)
    try:
        model.set_attn_implementation("eager")
    except Exception:  # older API: the config attribute above is enough
        pass
    model = model.float().eval()
    init_weights(model, fam)
    return model, cfg


def init_weights(model, fam):
    """Random weights scaled so activations stay O(1) and logits are peaked (stable greedy argmax), then
    rounded to bf16 (the checkpoint's dtype) so the fp32 reference sees exactly the stored values."""
    g = torch.Generator().manual_seed(fam["seed"])

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith("A_log"):
                v = torch.log(torch.rand(shape, generator=g) * 0.95 + 0.05)  # A in (0.05, 1): slow decays
            elif name.endswith("dt_bias"):
                v = normal(shape, 0.5, -1.0)
            elif name.endswith("conv1d.weight"):
                v = normal(shape, 0.5)
            elif "norm" in name.split(".")[-2] or name.endswith("norm.weight"):
                # Zero-centred RMSNorm weights are offsets from 1; the gated norm and plain RMSNorms hold w.
                zero_centred = fam["zero_centred"] and not name.endswith("linear_attn.norm.weight")
                v = normal(shape, 0.1) if zero_centred else normal(shape, 0.1, 1.0)
            elif name.endswith("embed_tokens.weight"):
                v = normal(shape, 1.0)
            elif name.endswith("lm_head.weight"):
                v = normal(shape, 2.0 / shape[-1] ** 0.5)
            elif name.endswith("mlp.gate.weight"):
                v = normal(shape, 2.0 / shape[-1] ** 0.5)  # spread router probabilities: no near-ties
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                v = normal(shape, 1.0 / shape[-1] ** 0.5)
            elif p.ndim == 2:
                v = normal(shape, 1.0 / shape[-1] ** 0.5)
            elif p.ndim == 1:
                v = normal(shape, 0.1)  # biases (none in these families)
            else:
                raise RuntimeError(f"no init rule for {name} {shape}")
            p.copy_(v.to(torch.bfloat16).to(torch.float32))


# ---------------------------------------------------------------------------------------------------
# Checkpoint naming: transformers' module names <-> checkpoint tensor names (experts split per expert)

def ckpt_name(torch_name, prefix):
    if torch_name.startswith("model."):
        return prefix + torch_name[len("model."):]
    return torch_name


def to_ckpt(state, prefix):
    """torch state dict -> {checkpoint name: fp32 tensor}, fused experts split into per-expert linears."""
    out = {}
    for k, v in state.items():
        name = ckpt_name(k, prefix)
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :inter].clone()  # gate rows first
                out[f"{base}{e}.up_proj.weight"] = v[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e].clone()
        else:
            out[name] = v.clone()
    return out


def from_ckpt(ck, state_template, prefix):
    """Inverse of to_ckpt, into the shapes of `state_template`."""
    out = {}
    for k, v in state_template.items():
        name = ckpt_name(k, prefix)
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            out[k] = torch.stack([torch.cat([ck[f"{base}{e}.gate_proj.weight"], ck[f"{base}{e}.up_proj.weight"]])
                                  for e in range(v.shape[0])])
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            out[k] = torch.stack([ck[f"{base}{e}.down_proj.weight"] for e in range(v.shape[0])])
        else:
            out[k] = ck[name]
        assert out[k].shape == v.shape, (k, out[k].shape, v.shape)
    return out


def linear_modules(model, prefix):
    """Checkpoint module names (no '.weight') of every linear layer, experts included, per expert."""
    names = []
    for mname, m in model.named_modules():
        if isinstance(m, nn.Linear):
            names.append(ckpt_name(mname, prefix))
    for pname, p in model.named_parameters():
        if pname.endswith("mlp.experts.gate_up_proj"):
            base = ckpt_name(pname, prefix)[: -len("gate_up_proj")]
            for e in range(p.shape[0]):
                names += [f"{base}{e}.gate_proj", f"{base}{e}.up_proj", f"{base}{e}.down_proj"]
    return sorted(set(names))


def is_routed_expert(module):
    parts = module.split(".")
    return "experts" in parts and parts[parts.index("experts") + 1].isdigit()


def is_router(module):
    return module.endswith("mlp.gate") or module.endswith("shared_expert_gate")


def quant_plan(variant, fam, modules):
    """{module: "nvfp4" | "fp8"} and the hf_quant_config.json 'quantization' block."""
    if variant in ("bf16", "mtp"):
        return {}, None
    if variant == "nvfp4":
        plan = {m: "nvfp4" for m in modules if is_routed_expert(m)}
        exclude = ["lm_head", "*self_attn*", "*linear_attn*", "*shared_expert*", "*mlp.gate_proj", "*mlp.up_proj",
                   "*mlp.down_proj"]
        if fam["prefix"] != "model.language_model.":
            exclude.append("*mlp.gate")
        # qwen3_5_moe: like the first public Qwen3.5 NVFP4 release, mlp.gate is missing from the list;
        # loaders must keep routers BF16 anyway.
        return plan, {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                      "exclude_modules": exclude}
    if variant == "nvfp4all":
        plan = {m: "nvfp4" for m in modules if m != "lm_head" and not is_router(m)}
        return plan, {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                      "exclude_modules": ["lm_head", "*mlp.gate", "*shared_expert_gate"]}
    if variant == "mixed":
        plan = {}
        for m in modules:
            if is_routed_expert(m):
                plan[m] = "nvfp4"
            elif "self_attn." in m or "shared_expert." in m:
                plan[m] = "fp8"
            elif "linear_attn." in m and not (m.endswith("in_proj_a") or m.endswith("in_proj_b")):
                plan[m] = "fp8"  # in_proj_a / in_proj_b stay BF16: not listed at all
        layers = {m: ({"quant_algo": "NVFP4", "group_size": 16} if s == "nvfp4" else {"quant_algo": "FP8"})
                  for m, s in sorted(plan.items())}
        return plan, {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8", "quantized_layers": layers}
    raise ValueError(variant)


def quantise_checkpoint(ck, plan):
    """Returns (tensors to save, fp32 reference weights)."""
    save, ref = {}, dict(ck)
    for name, w in ck.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        scheme = plan.get(module)
        if scheme == "nvfp4":
            q = nvfp4.quantize_nvfp4(w)
            save[module + ".weight"] = q["weight"]
            save[module + ".weight_scale"] = q["weight_scale"]
            save[module + ".weight_scale_2"] = q["weight_scale_2"]
            save[module + ".input_scale"] = torch.tensor(1.0 / 2688.0, dtype=torch.float32)
            ref[name] = nvfp4.dequantize_nvfp4(q["weight"], q["weight_scale"], q["weight_scale_2"])
        elif scheme == "fp8":
            q = nvfp4.quantize_fp8(w)
            save[module + ".weight"] = q["weight"]
            save[module + ".weight_scale"] = q["weight_scale"]
            save[module + ".input_scale"] = torch.tensor(1.0 / 448.0, dtype=torch.float32)
            ref[name] = nvfp4.dequantize_fp8(q["weight"], q["weight_scale"])
        else:
            save[name] = w.to(torch.bfloat16)
    return save, ref


def fuse_bf16_experts(save, num_layers, prefix):
    """Per-expert BF16 tensors -> mlp.experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I] (Qwen3.5 layout)."""
    out = dict(save)
    for layer in range(num_layers):
        base = f"{prefix}layers.{layer}.mlp.experts."
        e = 0
        gates, ups, downs = [], [], []
        while f"{base}{e}.gate_proj.weight" in save:
            gates.append(out.pop(f"{base}{e}.gate_proj.weight"))
            ups.append(out.pop(f"{base}{e}.up_proj.weight"))
            downs.append(out.pop(f"{base}{e}.down_proj.weight"))
            e += 1
        if gates:
            out[base + "gate_up_proj"] = torch.stack([torch.cat([gt, u]) for gt, u in zip(gates, ups)]).contiguous()
            out[base + "down_proj"] = torch.stack(downs).contiguous()
    return out


# ---------------------------------------------------------------------------------------------------
# The MTP head (see the module docstring)

class MtpHead(nn.Module):
    """Qwen3.5 / Qwen3-Next multi-token-prediction head from transformers' own classes: fc, the two pre-fc norms,
    one full-attention decoder layer of the target's type (built as the target's layer `full_layer`), mtp.norm.
    Embedding and lm_head are the target's."""

    def __init__(self, target, cfg, full_layer):
        super().__init__()
        hidden = cfg.hidden_size
        layer_cls = type(target.model.layers[full_layer])
        norm_cls = type(target.model.norm)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList([layer_cls(cfg, full_layer)])
        self.norm = norm_cls(hidden, eps=cfg.rms_norm_eps)
        self.full_layer = full_layer

    def fc_in(self, target, token_ids, hidden):
        emb = target.model.embed_tokens(token_ids)
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))

    @torch.no_grad()
    def run_layer(self, target, x):
        """The MTP layer over x [1, n, H] at positions 0 .. n-1, causal, no cache: the layer gets exactly the
        keyword arguments (rotary embeddings, mask, positions) the target's own full-attention layer gets for a
        sequence of n tokens."""
        n = x.shape[1]
        captured = {}

        def grab(mod, args, kwargs):
            captured.update(kwargs)
            captured["_args"] = args

        h = target.model.layers[self.full_layer].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            target.model(input_ids=torch.zeros((1, n), dtype=torch.long), use_cache=False)
        finally:
            h.remove()
        kwargs = {k: v for k, v in captured.items() if k not in ("_args", "hidden_states", "past_key_values",
                                                                  "past_key_value", "use_cache")}
        out = self.layers[0](x, **kwargs)
        if isinstance(out, tuple):
            out = out[0]
        return self.norm(out)


def build_mtp_head(model, cfg, fam):
    full_layer = max(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    head = MtpHead(model, cfg, full_layer).float().eval()
    init_weights(head, dict(fam, seed=fam["seed"] + MTP_SEED_OFFSET))
    return head


def mtp_checkpoint(head):
    """The head's tensors under their checkpoint names (mtp.*; BF16; experts fused like the main layers')."""
    out = {}
    for k, v in head.state_dict().items():
        out["mtp." + k] = v.detach().clone().to(torch.bfloat16)
    return out


@torch.no_grad()
def mtp_reference(model, head, tokens, steps):
    """(next token, draft tokens, draft logits [K, V], target hidden [L, H], lm_head self-check)."""
    ids = torch.tensor([tokens], dtype=torch.long)
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # after the final norm
    logits = model(input_ids=ids, use_cache=False).logits[0].float()
    selfcheck = (model.lm_head(hidden)[0].float() - logits).abs().max().item()
    nxt = int(torch.argmax(logits[-1]))
    entry_tokens = tokens[1:] + [nxt]
    x = head.fc_in(model, torch.tensor([entry_tokens], dtype=torch.long), hidden)  # [1, L, H]
    drafts, rows = [], []
    for _ in range(steps):
        g = head.run_layer(model, x)
        row = model.lm_head(g[0, -1]).float()
        d = int(torch.argmax(row))
        drafts.append(d)
        rows.append(row.clone())
        x_next = head.fc_in(model, torch.tensor([[d]], dtype=torch.long), g[:, -1:])
        x = torch.cat([x, x_next], dim=1)
    return nxt, drafts, torch.stack(rows), hidden[0].float().clone(), selfcheck


# ---------------------------------------------------------------------------------------------------
# Reference runs

@torch.no_grad()
def greedy_reference(model, tokens, steps):
    ids = torch.tensor([tokens], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    prefill = out.logits[0].float().clone()
    cache = out.past_key_values
    step_logits = [prefill[-1].clone()]
    chosen = [int(torch.argmax(prefill[-1]))]
    for _ in range(1, steps):
        out = model(input_ids=torch.tensor([[chosen[-1]]], dtype=torch.long), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        row = out.logits[0, -1].float().clone()
        step_logits.append(row)
        chosen.append(int(torch.argmax(row)))
    # Self-check: one uncached pass over prompt + greedy tokens gives the same logits as the cached steps
    full = model(input_ids=torch.tensor([tokens + chosen[:-1]], dtype=torch.long), use_cache=False).logits[0].float()
    cached = torch.stack(step_logits)
    selfcheck = (full[len(tokens) - 1:] - cached).abs().max().item()
    return prefill, chosen, cached, selfcheck


@torch.no_grad()
def kv_scales(model, cfg, prompts, prefix):
    """FP8 KV-cache scales (amax / 448, 25% margin for RoPE) measured on the prompts."""
    amax = {}
    hooks = []
    for mname, m in model.named_modules():
        if mname.endswith("self_attn.k_norm") or mname.endswith("self_attn.v_proj"):
            key = mname

            def hook(mod, inp, out, key=key):
                amax[key] = max(amax.get(key, 0.0), out.abs().max().item())
            hooks.append(m.register_forward_hook(hook))
    for t in prompts:
        model(input_ids=torch.tensor([t], dtype=torch.long), use_cache=False)
    for h in hooks:
        h.remove()
    out = {}
    for key, a in amax.items():
        layer_attn = ckpt_name(key.rsplit(".", 1)[0], prefix)
        if key.endswith("k_norm"):
            out[layer_attn + ".k_proj.k_scale"] = torch.tensor(a * 1.25 / 448.0, dtype=torch.float32)
        else:
            out[layer_attn + ".v_proj.v_scale"] = torch.tensor(a * 1.25 / 448.0, dtype=torch.float32)
    return out


def write_config(fam, cfg, model_dir):
    import transformers
    os.makedirs(model_dir, exist_ok=True)
    if fam.get("composite_config_class"):
        text = cfg.to_dict()
        try:
            composite_cls = getattr(transformers, fam["composite_config_class"])
            top = composite_cls(text_config=text, vision_config=dict(depth=1, hidden_size=32,
                                intermediate_size=64, num_heads=2, out_hidden_size=64))
        except Exception as e:  # write the nested layout by hand
            log(f"  composite config failed ({e}); writing config.json by hand")
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump({"architectures": [fam["architecture"]], "model_type": text["model_type"].replace("_text", ""),
                           "text_config": text, "tie_word_embeddings": False, "dtype": "bfloat16"}, f, indent=2,
                          default=str)
            top = None
    else:
        top = copy.deepcopy(cfg)
    if top is not None:
        top.architectures = [fam["architecture"]]
        try:
            top.dtype = torch.bfloat16
        except Exception:
            pass
        top.save_pretrained(model_dir)
        # transformers 5.17 writes Qwen3-MoE's expert count as "num_local_experts" (its attribute_map);
        # released Qwen3-MoE checkpoints spell it "num_experts": write that too, like a real config.json.
        path = os.path.join(model_dir, "config.json")
        with open(path) as f:
            written = json.load(f)
        if "num_local_experts" in written and "num_experts" not in written:
            written["num_experts"] = written["num_local_experts"]
            with open(path, "w") as f:
                json.dump(written, f, indent=2, sort_keys=True)
                f.write("\n")
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": GENERATION_EOS, "do_sample": False}, f, indent=2)


def save_safetensors(tensors, path):
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, path, metadata={"format": "pt"})


def make_fixture(family, variant, fam, out_root, versions):
    name = f"{family}_{variant}"
    log(f"=== {name}")
    model, cfg = build_model(fam)
    prefix = fam["prefix"]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tied = bool(fam["config"].get("tie_word_embeddings"))
    if tied:
        state.pop("lm_head.weight", None)
    ck = to_ckpt(state, prefix)
    modules = linear_modules(model, prefix)
    plan, quant_block = quant_plan(variant, fam, modules)
    save, ref = quantise_checkpoint(ck, plan)
    if fam["expert_layout"] == "fused" and not any(is_routed_expert(m) for m in plan):
        save = fuse_bf16_experts(save, cfg.num_hidden_layers, prefix)
    mtp_head = None
    if variant == "mtp":
        mtp_head = build_mtp_head(model, cfg, fam)
        save.update(mtp_checkpoint(mtp_head))
        # The reference head computes with the stored (bf16) values.
        mtp_head.load_state_dict({k[len("mtp."):]: v.float() for k, v in mtp_checkpoint(mtp_head).items()})

    # Load the reference weights (dequantised where quantised) back into the fp32 model.
    template = model.state_dict()
    if tied:
        template = {k: v for k, v in template.items() if k != "lm_head.weight"}
    model.load_state_dict(from_ckpt(ref, template, prefix), strict=not tied)
    if tied:
        model.tie_weights()

    g = torch.Generator().manual_seed(fam["seed"] + 7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]

    if variant == "mixed":
        save.update(kv_scales(model, cfg, prompts, prefix))

    fixture_dir = os.path.join(out_root, name)
    model_dir = os.path.join(fixture_dir, "model")
    write_config(fam, cfg, model_dir)
    if mtp_head is not None:
        path = os.path.join(model_dir, "config.json")
        with open(path) as f:
            written = json.load(f)
        (written["text_config"] if "text_config" in written else written)["mtp_num_hidden_layers"] = 1
        with open(path, "w") as f:
            json.dump(written, f, indent=2, sort_keys=True)
            f.write("\n")
    if quant_block is not None:
        with open(os.path.join(model_dir, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt", "version": "kiln-fixture"}, "quantization": quant_block},
                      f, indent=2)
    save_safetensors(save, os.path.join(model_dir, "model.safetensors"))

    expected, prompt_info = {}, []
    bf16_model = None
    if variant == "bf16":
        bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    worst_selfcheck = 0.0
    for i, toks in enumerate(prompts):
        prefill, chosen, step_logits, selfcheck = greedy_reference(model, toks, GREEDY_STEPS)
        worst_selfcheck = max(worst_selfcheck, selfcheck)
        rows = len(toks) if len(toks) <= ALL_POSITIONS_MAX_LEN else LONG_PROMPT_ROWS
        expected[f"p{i}.tokens"] = torch.tensor(toks, dtype=torch.int32)
        expected[f"p{i}.prefill_logits"] = prefill[-rows:].contiguous()
        expected[f"p{i}.greedy_tokens"] = torch.tensor(chosen, dtype=torch.int32)
        expected[f"p{i}.greedy_logits"] = step_logits.contiguous()
        top2 = torch.topk(step_logits, 2, dim=-1).values
        min_gap = (top2[:, 0] - top2[:, 1]).min().item()
        info = {"index": i, "length": len(toks), "prefill_first_pos": len(toks) - rows, "greedy_steps": GREEDY_STEPS,
                "min_top2_gap": min_gap, "selfcheck_cached_vs_uncached_max_abs": selfcheck}
        if bf16_model is not None:
            with torch.no_grad():
                lb = bf16_model(input_ids=torch.tensor([toks]), use_cache=False).logits[0, -1].float()
            expected[f"p{i}.prefill_last_logits_bf16"] = lb.contiguous()
            info["bf16_vs_fp32_last_logits_max_abs"] = (lb - prefill[-1]).abs().max().item()
        if mtp_head is not None:
            nxt, drafts, draft_logits, hidden, mtp_check = mtp_reference(model, mtp_head, toks, MTP_DRAFT_STEPS)
            if nxt != chosen[0]:
                log(f"  note: prompt {i}: uncached argmax {nxt} != cached {chosen[0]} (a near-tie); the chain "
                    f"starts from {nxt}, stored as next_token")
            expected[f"p{i}.next_token"] = torch.tensor([nxt], dtype=torch.int32)
            expected[f"p{i}.draft_tokens"] = torch.tensor(drafts, dtype=torch.int32)
            expected[f"p{i}.draft_logits"] = draft_logits.contiguous()
            expected[f"p{i}.target_hidden"] = hidden.contiguous()
            top2 = torch.topk(draft_logits, 2, dim=-1).values
            info["draft_min_top2_gap"] = (top2[:, 0] - top2[:, 1]).min().item()
            info["selfcheck_lm_head_of_hidden_max_abs"] = mtp_check
            log(f"  prompt {i}: drafts {drafts} (lm_head(hidden) vs logits {mtp_check:.2e})")
        prompt_info.append(info)
        log(f"  prompt {i}: len {len(toks)} greedy {chosen[:8]}... min top2 gap {min_gap:.4f} "
            f"selfcheck {selfcheck:.2e}" + (f" bf16 diff {info['bf16_vs_fp32_last_logits_max_abs']:.3e}"
                                           if bf16_model is not None else ""))
    save_safetensors(expected, os.path.join(fixture_dir, "expected.safetensors"))

    counts = {}
    for s in plan.values():
        counts[s] = counts.get(s, 0) + 1
    manifest = {
        "generated_by": "tools/reference/make_fixtures.py",
        "script_version": SCRIPT_VERSION,
        "versions": versions,
        "family": family,
        "variant": variant,
        "model_class": fam["model_class"],
        "reference": "transformers float32 on CPU, eager attention, torch fallback conv / gated delta rule; "
                     "weights = checkpoint values (bf16 upcast, nvfp4/fp8 dequantised in fp32)",
        "expert_layout": ("fused" if any(k.endswith("experts.gate_up_proj") for k in save) else
                          "per_expert" if any(is_routed_expert(m) for m in modules) else None),
        "quantized_modules": counts,
        "vocab_size": VOCAB,
        "prompts": prompt_info,
        "selfcheck_worst": worst_selfcheck,
        "checkpoint_bytes": os.path.getsize(os.path.join(model_dir, "model.safetensors")),
    }
    if mtp_head is not None:
        manifest["draft_steps"] = MTP_DRAFT_STEPS
        manifest["draft_rel_tol"] = 1e-3
        manifest["mtp_hidden_state"] = ("target's last hidden state after the final norm (lm_head's input); "
                                        "chain steps feed the head's mtp.norm output")
    with open(os.path.join(fixture_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder (tests/fixtures/reference)")
    ap.add_argument("--only", default="", help="comma-separated fixture names (default: all)")
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    import safetensors
    import transformers
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "safetensors": safetensors.__version__, "python": sys.version.split()[0]}
    log("versions", versions)
    for fam in FAMILIES.values():
        for cls in (fam["config_class"], fam["model_class"], fam.get("composite_config_class")):
            if cls:
                log(f"  {cls}: {'ok' if hasattr(transformers, cls) else 'MISSING'}")
    nvfp4._self_test()
    only = set(filter(None, args.only.split(",")))
    failures = []
    summary = {}
    for family, fam in FAMILIES.items():
        for variant in fam["variants"]:
            name = f"{family}_{variant}"
            if only and name not in only:
                continue
            try:
                m = make_fixture(family, variant, fam, args.out, versions)
                summary[name] = {"selfcheck_worst": m["selfcheck_worst"],
                                 "min_top2_gap": min(p["min_top2_gap"] for p in m["prompts"])}
            except Exception:
                traceback.print_exc()
                failures.append(name)
    log(json.dumps(summary, indent=1))
    if failures:
        log("FAILED:", failures)
        sys.exit(1)
    log("all fixtures written")


if __name__ == "__main__":
    main()
