// A full queue answers 503 with Retry-After and an OpenAI error body; the requests that got in finish,
// and the server drains back to idle. Run against `kiln serve --max-running-requests 1
// --max-queued-requests 2` (tests/integration/serve_load.sh).
import assert from "node:assert/strict";
import { test } from "node:test";
import OpenAI from "openai";
import { client, modelName, postRaw, sleep, waitIdle } from "./serve_lib.mjs";

const sdk = client();

test("beyond the queue limit: 503 + Retry-After; admitted requests complete", async () => {
  const model = await modelName();
  const slow = { model, messages: [{ role: "user", content: "go" }], max_tokens: 400, ignore_eos: true, temperature: 0 };
  // One runs, two wait; the rest must be refused at once.
  const admitted = [];
  for (let i = 0; i < 3; i++) {
    admitted.push(sdk.chat.completions.create(slow));
    await sleep(100);
  }
  const refused = await postRaw("/v1/chat/completions", slow);
  assert.equal(refused.status, 503, refused.text);
  assert.ok(refused.headers.get("retry-after"), "Retry-After header");
  assert.equal(refused.json.error.code, "queue_full");
  assert.ok(refused.json.error.message.includes("queue"));
  await assert.rejects(sdk.chat.completions.create(slow), (e) => {
    assert.ok(e instanceof OpenAI.APIError);
    assert.equal(e.status, 503);
    return true;
  });
  const done = await Promise.all(admitted);
  for (const r of done) {
    assert.equal(r.choices[0].finish_reason, "length");
    assert.equal(r.usage.completion_tokens, 400);
  }
  await waitIdle();
  // Room again.
  const ok = await sdk.chat.completions.create({ ...slow, max_tokens: 4 });
  assert.equal(ok.usage.completion_tokens, 4);
});
