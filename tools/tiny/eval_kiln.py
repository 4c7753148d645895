#!/usr/bin/env python3
"""Replays tools/tiny/eval_prompts.json through kiln and compares with transformers (Python stdlib only).

  python3 tools/tiny/eval_kiln.py --kiln build/bin/kiln [--model-path models/kiln-tiny] [--threads 2]
  python3 tools/tiny/eval_kiln.py --base-url http://127.0.0.1:30000   # a kiln serve already running

Starts `kiln serve` (the embedded model unless --model-path is given) on a free local port, sends every
prompt's token ids (`prompt_ids`, exactly what transformers was given) to /v1/completions with greedy
decoding (temperature 0), the same token limits as eval.py (340 thinking / 48 direct) and special tokens
kept in the text, then:
  * scores kiln's outputs with eval.py's rules (answer after </think> or the whole reply; arithmetic =
    last integer equals the result) and prints the per-mode table;
  * counts the prompts whose kiln output is identical to transformers' greedy output recorded in the file
    (`nvfp4`: the NVFP4 round trip of the routed experts, i.e. what models/kiln-tiny holds, and `bf16`).
Both outputs are compared after removing a final stop token (<|im_end|> / <|endoftext|>); a reply that
stopped on a stop token only matches one that stopped too.
"""
import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import eval as ev  # noqa: E402  (stdlib-only parts: split_output, score, summarize, format_table)

STOPS = ("<|im_end|>", "<|endoftext|>")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url, body=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read() or b"null")


def wait_healthy(base_url, proc, timeout_s=120):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"kiln serve at {base_url} not healthy after {timeout_s}s")


def normalize(text):
    """(text without a final stop token, stopped on a stop token)."""
    for s in STOPS:
        if text.endswith(s):
            return text[: -len(s)], True
    return text, False


def added_tokens(model_dir):
    """{id: text} of the tokenizer's added tokens (the stop tokens among them)."""
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        return {t["id"]: t["content"] for t in json.load(f)["added_tokens"]}


def complete(base_url, item, max_new, token_text):
    body = {"prompt": item["prompt_ids"], "max_tokens": max_new, "temperature": 0,
            "skip_special_tokens": False}
    _, resp = http_json(base_url + "/v1/completions", body)
    choice = resp["choices"][0]
    text = choice["text"]
    # kiln reports the stop token as matched_stop, outside the text; transformers' outputs end with it.
    if choice.get("finish_reason") == "stop" and isinstance(choice.get("matched_stop"), int):
        text += token_text[choice["matched_stop"]]
    return text, resp.get("usage", {}).get("completion_tokens")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", default="build/bin/kiln", help="kiln binary (started as kiln serve)")
    ap.add_argument("--model-path", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--base-url", default=None, help="use a running server instead of starting one")
    ap.add_argument("--prompts", default=os.path.join(HERE, "eval_prompts.json"))
    ap.add_argument("--threads", type=int, default=2, help="kiln serve --threads")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts of each mode (0: all)")
    ap.add_argument("--max-new-think", type=int, default=340)
    ap.add_argument("--max-new-direct", type=int, default=48)
    ap.add_argument("--write-json", default=None, help="write kiln's outputs and the comparison here")
    args = ap.parse_args()

    with open(args.prompts, encoding="utf-8") as f:
        doc = json.load(f)
    items = doc["items"]
    if args.limit:
        items = [it for mode in ("think", "direct") for it in [x for x in items if x["mode"] == mode][: args.limit]]

    token_text = added_tokens(args.model_path or os.path.join(HERE, "..", "..", "models", "kiln-tiny"))
    proc = None
    base_url = args.base_url
    if base_url is None:
        port = free_port()
        cmd = [args.kiln, "serve", "--host", "127.0.0.1", "--port", str(port), "--threads", str(args.threads)]
        if args.model_path:
            cmd += ["--model-path", args.model_path]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, proc)
        t0 = time.time()
        n_tokens = 0
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            futs = {pool.submit(complete, base_url, it,
                                args.max_new_think if it["enable_thinking"] else args.max_new_direct, token_text): it
                    for it in items}
            for fut in concurrent.futures.as_completed(futs):
                it = futs[fut]
                text, ntok = fut.result()
                reasoning, answer, finished = ev.split_output(text, it["enable_thinking"])
                it["kiln"] = {"output_text": text, "answer": answer, "finished": finished,
                              "correct": ev.score(it, answer), "n_tokens": ntok}
                n_tokens += ntok or 0
        wall = time.time() - t0
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    print(f"{len(items)} prompts in {wall:.0f}s ({n_tokens} tokens generated, {n_tokens / wall:.0f} tok/s overall)")
    print(ev.format_table("kiln (NVFP4 experts, greedy)", ev.summarize(items, "kiln")))
    report = {"prompts": len(items), "wall_s": round(wall, 1), "identical": {}}
    for ref in ("nvfp4", "bf16"):
        have = [it for it in items if ref in it]
        if not have:
            continue
        for mode in ("think", "direct", "all"):
            sel = [it for it in have if mode == "all" or it["mode"] == mode]
            same = [it for it in sel if normalize(it["kiln"]["output_text"]) == normalize(it[ref]["output_text"])]
            report["identical"][f"{ref}/{mode}"] = {"n": len(sel), "identical": len(same)}
            print(f"kiln == transformers {ref:5} ({mode:6}): {len(same)}/{len(sel)} "
                  f"({100.0 * len(same) / max(1, len(sel)):.1f}%)")
        diffs = [it for it in have if normalize(it["kiln"]["output_text"]) != normalize(it[ref]["output_text"])]
        for it in diffs[:3]:
            print(f"  differs from {ref} on item {it['id']} ({it['mode']}, {it['skill']}):\n"
                  f"    kiln:         {it['kiln']['output_text'][-160:]!r}\n"
                  f"    transformers: {it[ref]['output_text'][-160:]!r}")
    report["summary"] = ev.summarize(items, "kiln")
    if args.write_json:
        with open(args.write_json, "w", encoding="utf-8") as f:
            json.dump({"report": report, "items": [{"id": it["id"], "kiln": it["kiln"]} for it in items]}, f,
                      ensure_ascii=False, indent=1)
            f.write("\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
