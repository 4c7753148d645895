#!/usr/bin/env bash
# kiln template against the jinja2 oracle (tools/template_oracle.py): the prompt printed for a chat
# request on stdin must be byte-identical to what Python's jinja2 renders in Hugging Face's
# configuration, for a template given with --chat-template and for one found in a model folder
# (chat_template.jinja first, else tokenizer_config.json's chat_template, with its bos/eos tokens).
# A template's raise_exception must come back as one "error: <message>" line and exit status 1.
# Usage: template_cli.sh KILN_BINARY REPO_ROOT
set -euo pipefail
KILN=${1:?usage: template_cli.sh KILN_BINARY REPO_ROOT}
ROOT=${2:?usage: template_cli.sh KILN_BINARY REPO_ROOT}
ORACLE="$ROOT/tools/template_oracle.py"
FIX="$ROOT/tests/fixtures/templates"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -c "import jinja2" || { echo "FAIL: python3 with jinja2 is required (scripts/setup.sh)"; exit 1; }

# A few requests out of conversations.json.
python3 - "$FIX/conversations.json" "$WORK" <<'PY'
import json, sys
convs = {c["name"]: c["request"] for c in json.load(open(sys.argv[1], encoding="utf-8"))}
for name in ["system_user", "parallel_tool_calls", "unicode_content", "thinking_off", "only_system"]:
    with open(f"{sys.argv[2]}/{name}.json", "w", encoding="utf-8") as f:
        json.dump(convs[name], f, ensure_ascii=False)
PY

checks=0
compare() {  # compare LABEL KILN_ARGS... -- ORACLE_ARGS... < request
  local label=$1; shift
  local kiln_args=() oracle_args=()
  while [ "$1" != "--" ]; do kiln_args+=("$1"); shift; done
  shift
  oracle_args=("$@")
  local req="$WORK/req.json"
  cat > "$req"
  if python3 "$ORACLE" "${oracle_args[@]}" < "$req" > "$WORK/want" 2> "$WORK/want.err"; then
    "$KILN" template "${kiln_args[@]}" < "$req" > "$WORK/got" 2> "$WORK/got.err" \
      || { echo "FAIL $label: kiln failed: $(cat "$WORK/got.err")"; exit 1; }
    cmp -s "$WORK/want" "$WORK/got" || { echo "FAIL $label: prompts differ"; diff "$WORK/want" "$WORK/got" | head -20; exit 1; }
  else
    if "$KILN" template "${kiln_args[@]}" < "$req" > "$WORK/got" 2> "$WORK/got.err"; then
      echo "FAIL $label: jinja2 failed ($(tail -1 "$WORK/want.err")) but kiln printed a prompt"; exit 1
    fi
    # raise_exception: the same message, on one line.
    want_msg=$(sed -n 's/^TemplateError: //p' "$WORK/want.err")
    if [ -n "$want_msg" ] && [ "$(cat "$WORK/got.err")" != "error: $want_msg" ]; then
      echo "FAIL $label: expected 'error: $want_msg', got '$(cat "$WORK/got.err")'"; exit 1
    fi
  fi
  checks=$((checks + 1))
}

for tmpl in "$FIX"/*.jinja; do
  for req in "$WORK"/*.json; do
    [ "$(basename "$req")" = req.json ] && continue
    compare "$(basename "$tmpl") $(basename "$req")" --chat-template "$tmpl" -- --template "$tmpl" < "$req"
  done
done

# Model folder: tokenizer_config.json with a list of named templates and AddedToken-style bos/eos.
MODEL="$WORK/model"
mkdir -p "$MODEL"
echo '{}' > "$MODEL/config.json"
python3 - "$FIX/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja" "$MODEL/tokenizer_config.json" <<'PY'
import json, sys
template = open(sys.argv[1], encoding="utf-8").read()
json.dump({"bos_token": {"content": "<｜begin▁of▁sentence｜>", "lstrip": False},
           "eos_token": "<｜end▁of▁sentence｜>",
           "chat_template": [{"name": "tool_use", "template": "unused"}, {"name": "default", "template": template}]},
          open(sys.argv[2], "w", encoding="utf-8"), ensure_ascii=False)
PY
compare "model dir tokenizer_config" --model-path "$MODEL" -- \
  --template "$FIX/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja" --bos-token "<｜begin▁of▁sentence｜>" \
  --eos-token "<｜end▁of▁sentence｜>" < "$WORK/system_user.json"
# chat_template.jinja takes precedence over tokenizer_config.json.
cp "$FIX/Qwen3.5-4B.jinja" "$MODEL/chat_template.jinja"
compare "model dir chat_template.jinja" --model-path "$MODEL" -- --template "$FIX/Qwen3.5-4B.jinja" \
  --bos-token "<｜begin▁of▁sentence｜>" < "$WORK/parallel_tool_calls.json"

# Bad input: one clear line.
if echo '{"messages": 3}' | "$KILN" template --model-path "$MODEL" > /dev/null 2> "$WORK/err"; then
  echo "FAIL: a request without a messages list was accepted"; exit 1
fi
grep -q '^error: chat request: "messages"' "$WORK/err" || { echo "FAIL: unexpected error: $(cat "$WORK/err")"; exit 1; }
echo "OK: $checks kiln template renders identical to jinja2"
