#!/usr/bin/env bash
# Images end to end through `kiln serve` on a model with a real (random-weight) vision tower.
#
# The model: a tiny Qwen3_5MoeForConditionalGeneration (kiln-tiny's text shape, its tokenizer and chat template, a
# 1-block vision tower of hidden 32 whose output is kiln-tiny's hidden size 256), written by `kiln dummy-checkpoint`:
# random weights in the release layout, the tower under model.visual. included. One PNG goes through the three APIs
# (chat completions image_url, Responses input_image, Anthropic image block), greedy, 8 tokens:
#   - every API answers 200, and its prompt counts the image: prompt tokens with the image minus those of the same
#     request without it = <|vision_start|> + 77 image tokens + <|vision_end|> = 79. 77 is worked out here from transformers' smart_resize (factor 32, Qwen3.5's min_pixels 65536):
#     a 20 x 12 image scales by sqrt(65536 / 240) to 224 x 352 pixels, 14 x 22 patches of 16, / 4 per merged token;
#   - with KILN_TEST_DEVICES="cpu cuda" (the GPU machine: tools/gpu/README.md) the same requests on
#     `--device cuda --dtype float32` give the CPU's text, API by API (the CPU backend being the reference that the
#     transformers fixtures check).
# Usage: serve_images.sh KILN_BINARY [REPO_ROOT]
set -euo pipefail
KILN=${1:?usage: serve_images.sh KILN_BINARY [REPO_ROOT]}
ROOT=${2:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
source "$ROOT/tests/integration/lib/serve_lib.sh"
SERVE_WORK=$(mktemp -d)
trap serve_cleanup EXIT
DEVICES=${KILN_TEST_DEVICES:-cpu}

# The config: kiln-tiny's text settings under text_config, a small vision_config, kiln-tiny's image token ids.
mkdir -p "$SERVE_WORK/cfg"
python3 - "$ROOT/models/kiln-tiny/config.json" "$SERVE_WORK/cfg/config.json" <<'EOF'
import json, sys
text = json.load(open(sys.argv[1]))
text.pop("architectures", None)
text["model_type"] = "qwen3_5_moe_text"
cfg = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "text_config": text,
    "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 32, "in_channels": 3, "intermediate_size": 64, "num_heads": 2,
                      "num_position_embeddings": 64, "out_hidden_size": text["hidden_size"], "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_start_token_id": 2057, "vision_end_token_id": 2058, "image_token_id": 2060, "video_token_id": 2061,
    "tie_word_embeddings": False,
}
json.dump(cfg, open(sys.argv[2], "w"), indent=2)
EOF
"$KILN" dummy-checkpoint --model-path "$SERVE_WORK/cfg" --output "$SERVE_WORK/vl" \
  --tokenizer-from "$ROOT/models/kiln-tiny" > "$SERVE_WORK/dummy.log" 2>&1 ||
  { echo "FAIL: dummy-checkpoint"; cat "$SERVE_WORK/dummy.log"; exit 1; }
"$KILN" inspect --model-path "$SERVE_WORK/vl" > "$SERVE_WORK/inspect.txt" 2>&1 ||
  { echo "FAIL: inspect"; cat "$SERVE_WORK/inspect.txt"; exit 1; }
grep -qi "vision" "$SERVE_WORK/inspect.txt" || { echo "FAIL: inspect names no vision tower:"; cat "$SERVE_WORK/inspect.txt"; exit 1; }

PNG_B64=$(base64 -w0 "$ROOT/tests/fixtures/media/png_rgb_20x12.png")
# request API WITH_IMAGE: the request body of that API, the image first, then the text.
request() {
  python3 - "$1" "$2" "$PNG_B64" <<'EOF'
import json, sys
api, with_image, b64 = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
url = "data:image/png;base64," + b64
text = "What is in this picture?"
if api == "chat":
    parts = ([{"type": "image_url", "image_url": {"url": url}}] if with_image else []) + [{"type": "text", "text": text}]
    body = {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": 8, "temperature": 0}
elif api == "responses":
    parts = ([{"type": "input_image", "image_url": url}] if with_image else []) + [{"type": "input_text", "text": text}]
    body = {"model": "m", "input": [{"role": "user", "content": parts}], "max_output_tokens": 8, "temperature": 0}
else:
    parts = ([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]
             if with_image else []) + [{"type": "text", "text": text}]
    body = {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": 8, "temperature": 0}
print(json.dumps(body))
EOF
}
path_of() { case $1 in chat) echo /v1/chat/completions ;; responses) echo /v1/responses ;; *) echo /v1/messages ;; esac; }
# answer API JSON: "prompt_tokens<TAB>text" of a response of that API.
answer() {
  python3 - "$1" "$2" <<'EOF'
import json, sys
api, r = sys.argv[1], json.loads(sys.argv[2])
if api == "chat":
    print(r["usage"]["prompt_tokens"], json.dumps(r["choices"][0]["message"]), sep="\t")
elif api == "responses":
    items = [[o.get("type")] + [c.get("text") for c in o.get("content", []) + o.get("summary", [])] for o in r["output"]]
    print(r["usage"]["input_tokens"], json.dumps(items), sep="\t")  # without the items' ids (fresh per response)
else:
    u = r["usage"]  # Anthropic counts prefix-cache hits apart
    print(u["input_tokens"] + u.get("cache_read_input_tokens", 0), json.dumps(r["content"]), sep="\t")
EOF
}

declare -A TEXT
for dev in $DEVICES; do
  args=(--model-path "$SERVE_WORK/vl" --served-model-name m --device "$dev" --max-running-requests 2)
  [ "$dev" = cpu ] && args+=(--threads 2)
  [ "$dev" = cuda ] && args+=(--dtype float32)
  start_server "$dev" "${args[@]}"
  url_var="URL_$dev"
  log_var="LOG_$dev"
  grep -q "images:" "${!log_var}" || { echo "FAIL: no images line in the startup summary ($dev)"; cat "${!log_var}"; exit 1; }
  for api in chat responses anthropic; do
    declare -A N=()
    for img in 1 0; do
      code=$(curl -s -o "$SERVE_WORK/r.json" -w '%{http_code}' -H 'Content-Type: application/json' \
        -H 'anthropic-version: 2023-06-01' -d "$(request $api $img)" "${!url_var}$(path_of $api)")
      [ "$code" = 200 ] || { echo "FAIL: $dev $api (image $img): HTTP $code"; cat "$SERVE_WORK/r.json"; exit 1; }
      IFS=$'\t' read -r n text <<< "$(answer $api "$(cat "$SERVE_WORK/r.json")")"
      N[$img]=$n
      [ "$img" = 1 ] && TEXT[$dev.$api]=$text
    done
    diff=$((N[1] - N[0]))
    [ "$diff" = 79 ] || { echo "FAIL: $dev $api: the image added $diff prompt tokens, want 79 (77 + 2)"; exit 1; }
    echo "ok: $dev $api: 200, the image is 79 prompt tokens (${N[1]} with, ${N[0]} without): ${TEXT[$dev.$api]:0:120}"
  done
  stop_server "$dev"
done
for dev in $DEVICES; do
  [ "$dev" = cpu ] && continue
  for api in chat responses anthropic; do
    [ "${TEXT[$dev.$api]}" = "${TEXT[cpu.$api]}" ] ||
      { echo "FAIL: $api on $dev differs from the CPU: ${TEXT[$dev.$api]} vs ${TEXT[cpu.$api]}"; exit 1; }
    echo "ok: $api on $dev equals the CPU's output"
  done
done
echo "PASS: serve_images"
