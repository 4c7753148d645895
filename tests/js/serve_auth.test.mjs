// --api-key: every API endpoint wants "Authorization: Bearer KEY"; /health and /metrics stay open.
// Run against `kiln serve --api-key $KILN_API_KEY` (tests/integration/serve_auth.sh).
import assert from "node:assert/strict";
import { test } from "node:test";
import OpenAI from "openai";
import { API_KEY, BASE_URL, client } from "./serve_lib.mjs";

test("requests without the key or with a wrong one get 401", async () => {
  assert.ok(API_KEY, "KILN_API_KEY must be set");
  for (const key of ["wrong-key", API_KEY + "x", ""]) {
    const sdk = client({ apiKey: key || "none" });
    await assert.rejects(sdk.models.list(), (e) => {
      assert.ok(e instanceof OpenAI.AuthenticationError, String(e));
      assert.equal(e.status, 401);
      assert.equal(e.code, "invalid_api_key");
      return true;
    });
    await assert.rejects(sdk.chat.completions.create({ model: "x", messages: [{ role: "user", content: "hi" }] }), (e) => e.status === 401);
  }
  for (const path of ["/get_model_info", "/get_server_info", "/v1/models"]) {
    const r = await fetch(`${BASE_URL}${path}`);
    assert.equal(r.status, 401, path);
    assert.ok(JSON.parse(await r.text()).error.message);
  }
  const r = await fetch(`${BASE_URL}/tokenize`, { method: "POST", body: JSON.stringify({ prompt: "x" }) });
  assert.equal(r.status, 401);
});

test("the right key works; health and metrics are open", async () => {
  const sdk = client();
  const models = await sdk.models.list();
  const r = await sdk.chat.completions.create({ model: models.data[0].id, messages: [{ role: "user", content: "hi" }], max_tokens: 4 });
  assert.ok(r.choices.length === 1);
  assert.equal((await fetch(`${BASE_URL}/health`)).status, 200);
  assert.equal((await fetch(`${BASE_URL}/metrics`)).status, 200);
});
