// A full queue answers 503 with Retry-After and an OpenAI error body; the requests that got in finish,
// and the server drains back to idle. Run against `kiln serve --max-running-requests 1
// --max-queued-requests 2` (tests/integration/serve_load.sh): of six requests sent at once, one runs,
// two wait, three are refused.
import assert from "node:assert/strict";
import { test } from "node:test";
import OpenAI from "openai";
import { client, modelName, postRaw, waitIdle } from "./serve_lib.mjs";

const sdk = client();

test("beyond the queue limit: 503 + Retry-After; admitted requests complete", async () => {
  const model = await modelName();
  const slow = { model, messages: [{ role: "user", content: "go" }], max_tokens: 400, ignore_eos: true, temperature: 0 };
  const answers = await Promise.all(Array.from({ length: 6 }, () => postRaw("/v1/chat/completions", slow)));
  const ok = answers.filter((a) => a.status === 200);
  const refused = answers.filter((a) => a.status !== 200);
  assert.ok(ok.length >= 3, `at least one running + two queued succeed (got ${ok.length})`);
  assert.ok(refused.length >= 1, "some requests are refused");
  for (const r of refused) {
    assert.equal(r.status, 503, r.text);
    assert.ok(r.headers.get("retry-after"), "Retry-After header");
    assert.equal(r.json.error.code, "queue_full");
    assert.match(r.json.error.message, /queue/);
  }
  for (const r of ok) {
    assert.equal(r.json.choices[0].finish_reason, "length");
    assert.equal(r.json.usage.completion_tokens, 400);
  }
  // The SDK surfaces the 503 as an APIError (after its own retries, here disabled).
  const burst = Array.from({ length: 6 }, () => sdk.chat.completions.create(slow));
  const settled = await Promise.allSettled(burst);
  const rejected = settled.filter((s) => s.status === "rejected");
  assert.ok(rejected.length >= 1);
  for (const s of rejected) {
    assert.ok(s.reason instanceof OpenAI.APIError, String(s.reason));
    assert.equal(s.reason.status, 503);
  }
  await waitIdle();
  const again = await sdk.chat.completions.create({ ...slow, max_tokens: 4 });
  assert.equal(again.usage.completion_tokens, 4);
});
