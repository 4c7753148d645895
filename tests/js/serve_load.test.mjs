// `kiln serve` under concurrency, through the openai SDK: many streams at once give exactly what each
// gives alone (greedy), client disconnects free their capacity, and the server stays healthy.
// Run against a real runner (KILN_MODEL_KIND=fixture or embedded) or the hash dummy runner.
import assert from "node:assert/strict";
import { test } from "node:test";
import { client, getJson, metrics, modelName, sleep, streamChat, waitIdle } from "./serve_lib.mjs";

const sdk = client();
const CONCURRENCY = Number(process.env.KILN_TEST_CONCURRENCY ?? 40);

function request(i) {
  // Prompts of different lengths, so prefill chunks and decodes of different requests share steps.
  const filler = " and".repeat((i * 13) % 60);
  return {
    messages: [{ role: "user", content: `Request ${i}: count the words${filler}.` }],
    max_tokens: 24,
    temperature: 0,
    ignore_eos: true,
  };
}

function text(r) {
  return `${r.reasoning}\u0000${r.content}`;
}

test(`${CONCURRENCY} concurrent streams equal the same requests run alone`, async () => {
  const model = await modelName();
  const alone = [];
  for (let i = 0; i < CONCURRENCY; i++) alone.push(await streamChat({ model, ...request(i) }));
  for (const r of alone) assert.equal(r.finish, "length");
  const before = await metrics();
  const together = await Promise.all(Array.from({ length: CONCURRENCY }, (_, i) => streamChat({ model, ...request(i) })));
  for (let i = 0; i < CONCURRENCY; i++) {
    assert.equal(text(together[i]), text(alone[i]), `request ${i} differs when batched`);
    assert.equal(together[i].finish, "length");
  }
  const after = await metrics();
  assert.equal(after["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"], CONCURRENCY * 24);
  await waitIdle();
});

test("non-streamed and streamed answers agree under load", async () => {
  const model = await modelName();
  const jobs = [];
  for (let i = 0; i < 16; i++) {
    jobs.push(sdk.chat.completions.create({ model, ...request(i) }));
    jobs.push(streamChat({ model, ...request(i) }));
  }
  const results = await Promise.all(jobs);
  for (let i = 0; i < 16; i++) {
    const plain = results[2 * i].choices[0].message;
    const streamed = results[2 * i + 1];
    assert.equal(`${plain.reasoning_content ?? ""}\u0000${plain.content ?? ""}`, text(streamed), `request ${i}`);
  }
  await waitIdle();
});

test("clients that disconnect mid-stream free their KV pages", async () => {
  const model = await modelName();
  const controllers = [];
  const started = [];
  for (let i = 0; i < 8; i++) {
    const ac = new AbortController();
    controllers.push(ac);
    started.push(
      (async () => {
        const stream = await sdk.chat.completions.create(
          { model, ...request(i), max_tokens: 1500, stream: true },
          { signal: ac.signal },
        );
        try {
          for await (const chunk of stream) {
            if (chunk.choices.length) break;  // first token seen: hang up
          }
        } catch {}
        return true;
      })(),
    );
  }
  await Promise.all(started);
  for (const ac of controllers) ac.abort();
  await waitIdle(10_000);
  const m = await metrics();
  assert.equal(m["kiln:kv_pages_used"], 0);
  // Everything still works.
  const r = await streamChat({ model, ...request(1) });
  assert.equal(r.finish, "length");
});

test("health and metrics answer while streams run", async () => {
  const model = await modelName();
  const streams = Array.from({ length: 12 }, (_, i) => streamChat({ model, ...request(i), max_tokens: 64 }));
  await sleep(20);
  for (let k = 0; k < 5; k++) {
    assert.equal((await getJson("/health")).status, 200);
    assert.equal((await getJson("/metrics")).status, 200);
  }
  await Promise.all(streams);
  await waitIdle();
});
