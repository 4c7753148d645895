#!/usr/bin/env python3
"""Evaluates kiln-tiny with transformers greedy decoding and writes a replayable prompt file.

  python3 tools/tiny/eval.py --model DIR [--nvfp4] [--per-mode 300] [--write-json tools/tiny/eval_prompts.json]

The prompts come from gen_data.py's skill set with a fixed seed (EVAL_SEED), rendered with the real
chat template (thinking and non-thinking). For each prompt the JSON holds the messages, the rendered
prompt text and its token ids, the expected answer, and transformers' greedy output for the BF16
weights and for the NVFP4 round trip of the routed experts (what `kiln quantize` ships), so a
kiln-side script can replay the same prompts against `kiln generate` / `kiln serve` and compare.

Scoring: the answer is the text after the first `</think>` (thinking) or the whole output (direct),
without <|im_end|>. Arithmetic is correct when the last integer in the answer equals the true result;
`ok`/`self`/`greet` need the exact expected text; `recall` needs the remembered value in the answer.
"""
import argparse
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_data  # noqa: E402
import nvfp4  # noqa: E402

EVAL_SEED = 20240917
# Prompts per mode: arithmetic (split evenly between +, -, *) and the other skills.
EVAL_COUNTS = {"add": 100, "sub": 100, "mul": 100, "ok": 60, "self": 20, "recall": 40, "greet": 10}
ARITH = ("add", "sub", "mul")


def build_items(per_mode_arith=300, seed=EVAL_SEED):
    """Evaluation conversations: for each mode (thinking first), EVAL_COUNTS scaled so arithmetic has
    `per_mode_arith` prompts. Returns a list of dicts with messages (prompt part), expected, etc."""
    import random
    rng = random.Random(seed)
    scale = per_mode_arith / sum(EVAL_COUNTS[s] for s in ARITH)
    items = []
    for thinking in (True, False):
        for skill, count in EVAL_COUNTS.items():
            for _ in range(max(1, round(count * scale))):
                conv = gen_data.make_conversation(rng, thinking, skill)
                last = conv["messages"][-1]
                meta = conv["meta"]
                expected = str(meta["result"]) if skill in ARITH else meta["expected"]
                prompt = gen_data.render_prompt(conv["messages"][:-1], thinking)
                items.append({
                    "id": len(items), "mode": "think" if thinking else "direct", "skill": skill,
                    "enable_thinking": thinking, "messages": conv["messages"][:-1], "prompt": prompt,
                    "expected": expected, "reference_answer": last["content"],
                })
    return items


def split_output(text, thinking):
    """(reasoning, answer, finished) of a decoded output (special tokens kept in `text`)."""
    finished = text.endswith("<|im_end|>") or text.endswith("<|endoftext|>")
    for stop in ("<|im_end|>", "<|endoftext|>"):
        if text.endswith(stop):
            text = text[: -len(stop)]
    if thinking:
        if "</think>" not in text:
            return text, "", finished
        reasoning, answer = text.split("</think>", 1)
        return reasoning.strip(), answer.strip(), finished
    return "", text.strip(), finished


def score(item, answer):
    skill, expected = item["skill"], item["expected"]
    if skill in ARITH:
        nums = re.findall(r"-?\d+", answer)
        return bool(nums) and nums[-1] == expected
    if skill == "recall":
        return expected in answer
    return answer == expected


def summarize(items, key):
    """Accuracy table rows per mode for results stored under item[key]."""
    rows = {}
    for mode in ("think", "direct"):
        sel = [it for it in items if it["mode"] == mode and key in it]
        if not sel:
            continue
        row = {}
        for group, skills in [("arith", ARITH), ("add", ("add",)), ("sub", ("sub",)), ("mul", ("mul",)),
                              ("ok", ("ok",)), ("self", ("self",)), ("recall", ("recall",)),
                              ("greet", ("greet",))]:
            g = [it for it in sel if it["skill"] in skills]
            if g:
                row[group] = {"n": len(g), "correct": sum(it[key]["correct"] for it in g)}
        row["unfinished"] = sum(not it[key]["finished"] for it in sel)
        rows[mode] = row
    return rows


def format_table(title, rows):
    cols = ["arith", "add", "sub", "mul", "ok", "self", "recall", "greet"]
    lines = [title, "mode    " + "".join(f"{c:>14}" for c in cols) + "   unfinished"]
    for mode, row in rows.items():
        cells = []
        for c in cols:
            if c in row:
                r = row[c]
                cells.append(f"{100.0 * r['correct'] / r['n']:6.1f}% ({r['n']:3d})")
            else:
                cells.append(" " * 14)
        lines.append(f"{mode:8}" + "".join(f"{x:>14}" for x in cells) + f"   {row['unfinished']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# torch parts


def greedy_generate(model, prompt_ids, max_new, eos_ids, pad_id, batch_size=512, deadline=None):
    """Batched greedy decoding with left padding. Positions start at 0 at each prompt's first token
    and padded positions are masked, so each row computes what an unpadded run computes. Returns the
    generated ids per prompt (the stop token included when one was produced)."""
    import torch
    device = next(model.parameters()).device
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    results = [None] * len(prompt_ids)
    eos = set(eos_ids)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = [prompt_ids[i] for i in idx]
        b, width = len(batch), max(len(p) for p in batch)
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for r, p in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                        logits_to_keep=1)
            cache = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1)
            cur = pos[:, -1]
            gen = [[] for _ in range(b)]
            done = [False] * b
            for _ in range(max_new):
                toks = nxt.tolist()
                for r in range(b):
                    if not done[r]:
                        gen[r].append(toks[r])
                        if toks[r] in eos:
                            done[r] = True
                if all(done) or (deadline is not None and time.time() > deadline):
                    break
                mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=device)], dim=1)
                cur = cur + 1
                out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=cur[:, None],
                            past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1)
        for r, i in enumerate(idx):
            results[i] = gen[r]
    return results


def apply_nvfp4_roundtrip(model):
    """Replaces every routed expert weight by its NVFP4 round trip (what kiln quantize ships)."""
    import torch
    with torch.no_grad():
        for layer in model.model.layers:
            ex = layer.mlp.experts
            ex.gate_up_proj.copy_(nvfp4.fake_quant_experts(ex.gate_up_proj.data, 2))
            ex.down_proj.copy_(nvfp4.fake_quant_experts(ex.down_proj.data, 1))


def load_model(model_dir, device="cuda"):
    import torch
    from transformers import Qwen3_5MoeForCausalLM
    # fp32 compute over the BF16 weights (exact upcast), eager attention (NaN-free with left padding).
    model = Qwen3_5MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.to(device).eval()


def run_eval(model_dir, items, max_new_think, max_new_direct, variants=("bf16", "nvfp4"), deadline=None,
             log=print):
    """Runs each variant over the items, storing results in item[variant]. Returns summary rows."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    eos_ids = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    pad_id = tok.token_to_id("<|endoftext|>")
    for it in items:
        it["prompt_ids"] = tok.encode(it["prompt"], add_special_tokens=False).ids
    summaries = {}
    for variant in variants:
        t0 = time.time()
        model = load_model(model_dir)
        if variant == "nvfp4":
            apply_nvfp4_roundtrip(model)
        for mode, max_new in (("think", max_new_think), ("direct", max_new_direct)):
            sel = [it for it in items if it["mode"] == mode]
            outs = greedy_generate(model, [it["prompt_ids"] for it in sel], max_new, eos_ids, pad_id,
                                   deadline=deadline)
            for it, ids in zip(sel, outs):
                text = tok.decode(ids, skip_special_tokens=False)
                reasoning, answer, finished = split_output(text, it["enable_thinking"])
                it[variant] = {"output_text": text, "answer": answer, "finished": finished,
                               "correct": score(it, answer), "n_tokens": len(ids)}
        summaries[variant] = summarize(items, variant)
        log(format_table(f"{variant}: transformers greedy ({time.time() - t0:.0f}s)", summaries[variant]))
        del model
    return summaries


def check_hf_tokenizer(model_dir, items, log=print):
    """transformers' AutoTokenizer + apply_chat_template must give the same prompt text and ids as our
    renderer + the raw tokenizer. Returns the number of mismatches."""
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(model_dir)
    bad = 0
    for it in items:
        kwargs = {} if it["enable_thinking"] else {"enable_thinking": False}
        text = hf.apply_chat_template(it["messages"], tokenize=False, add_generation_prompt=True, **kwargs)
        ids = hf(text, add_special_tokens=False)["input_ids"]
        if text != it["prompt"] or ids != it["prompt_ids"]:
            bad += 1
            if bad <= 3:
                log(f"hf tokenizer/template mismatch on item {it['id']}:\n{text!r}\n{it['prompt']!r}\n"
                    f"{ids}\n{it['prompt_ids']}")
    log(f"hf AutoTokenizer + apply_chat_template vs kiln-tiny renderer: {len(items) - bad}/{len(items)} identical")
    return bad


def write_json(path, items, summaries, model_dir_name="kiln-tiny"):
    keep = ["id", "mode", "skill", "enable_thinking", "messages", "prompt", "prompt_ids", "expected",
            "reference_answer", "bf16", "nvfp4"]
    doc = {
        "description": "kiln-tiny evaluation prompts with transformers greedy outputs (generated by "
                       "tools/tiny/eval.py; do not edit). 'bf16': BF16 weights computed in fp32; 'nvfp4': "
                       "routed experts replaced by their NVFP4 round trip (the shipped models/kiln-tiny).",
        "model": model_dir_name,
        "seed": EVAL_SEED,
        "scoring": "answer = text after </think> (thinking) or whole output (direct), stop token removed; "
                   "arithmetic: last integer == expected; recall: expected in answer; others: exact match",
        "summary": summaries,
        "items": [{k: it[k] for k in keep if k in it} for it in items],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="BF16 model directory (transformers format)")
    ap.add_argument("--per-mode", type=int, default=300, help="arithmetic prompts per mode")
    ap.add_argument("--variants", default="bf16,nvfp4")
    ap.add_argument("--max-new-think", type=int, default=640)
    ap.add_argument("--max-new-direct", type=int, default=64)
    ap.add_argument("--write-json", default=None)
    ap.add_argument("--print-prompts", action="store_true", help="only print the prompts (no torch needed)")
    args = ap.parse_args()
    items = build_items(args.per_mode)
    if args.print_prompts:
        for it in items:
            print(json.dumps({k: it[k] for k in ("id", "mode", "skill", "prompt", "expected")}))
        return
    summaries = run_eval(args.model, items, args.max_new_think, args.max_new_direct,
                         variants=tuple(args.variants.split(",")))
    if args.write_json:
        write_json(args.write_json, items, summaries)


if __name__ == "__main__":
    main()
