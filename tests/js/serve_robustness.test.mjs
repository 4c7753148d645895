// Hostile and broken clients: malformed requests, random bytes, truncated bodies, slow clients,
// mid-stream disconnects. Afterwards the server must answer a normal request exactly as before and
// hold no capacity (KV pages, running or queued requests).
import assert from "node:assert/strict";
import { test } from "node:test";
import { BASE_URL, client, getJson, modelName, postRaw, rawExchange, sleep, streamChat, waitIdle } from "./serve_lib.mjs";

const sdk = client();
const reference = { messages: [{ role: "user", content: "Reference request." }], max_tokens: 16, temperature: 0, ignore_eos: true };
let before = null;

test("reference answer before the abuse", async () => {
  before = await streamChat({ model: await modelName(), ...reference });
  assert.equal(before.finish, "length");
});

test("malformed JSON and wrong types: 400 with an OpenAI error body", async () => {
  const model = await modelName();
  const bodies = [
    "",
    "{",
    "null",
    "[]",
    '"just a string"',
    "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]",
    JSON.stringify({ model, messages: null }),
    JSON.stringify({ model, messages: [{}] }),
    JSON.stringify({ model, messages: [{ role: 5, content: "x" }] }),
    JSON.stringify({ model, messages: [{ role: "user", content: { text: "x" } }] }),
    JSON.stringify({ model, messages: [{ role: "user", content: "x" }], max_tokens: "ten" }),
    JSON.stringify({ model, messages: [{ role: "user", content: "x" }], temperature: null, top_k: 1.5 }),
    JSON.stringify({ model, messages: [{ role: "user", content: "x" }], stop: { a: 1 } }),
    JSON.stringify({ model, messages: [{ role: "user", content: "x" }], logprobs: true, top_logprobs: 99 }),
    JSON.stringify({ model, messages: [{ role: "user", content: "x" }], seed: 1.5 }),
    JSON.stringify({ model, messages: [{ role: "user", content: "x" }], n: 1e9 }),
    JSON.stringify({ model, messages: [{ role: "user", content: "x" }], tools: [{ type: "retrieval" }] }),
    JSON.stringify({ model, prompt: "x" }),  // a completions body sent to chat
    "\u0000\u0001\u0002",
    "{\"messages\": [{\"role\": \"user\", \"content\": \"\\ud800\"}]}",
  ];
  for (const body of bodies) {
    const r = await postRaw("/v1/chat/completions", body);
    assert.equal(r.status, 400, `${JSON.stringify(body)} -> ${r.status} ${r.text}`);
    assert.ok(r.json && r.json.error && typeof r.json.error.message === "string", `${JSON.stringify(body)} -> ${r.text}`);
    for (const key of ["message", "type", "param", "code"]) assert.ok(key in r.json.error, `error.${key} missing`);
  }
  for (const body of ["{", JSON.stringify({ model, prompt: 5 }), JSON.stringify({ model, prompt: [1, -4] }), JSON.stringify({ model })]) {
    const r = await postRaw("/v1/completions", body);
    assert.equal(r.status, 400, `${body} -> ${r.text}`);
    assert.ok(r.json.error.message);
  }
  const wrongMethod = await getJson("/v1/chat/completions");
  assert.ok(wrongMethod.status === 404 || wrongMethod.status === 405);
  assert.ok(JSON.parse(wrongMethod.body).error);
});

test("oversized body: 413", async () => {
  const huge = JSON.stringify({ messages: [{ role: "user", content: "x".repeat(40 << 20) }] });
  let status = 0;
  try {
    const r = await fetch(`${BASE_URL}/v1/chat/completions`, { method: "POST", headers: { "Content-Type": "application/json" }, body: huge });
    status = r.status;
    if (status === 413) assert.ok(JSON.parse(await r.text()).error.message.includes("limit"));
  } catch {
    status = 413;  // the server may close the connection before the client finished sending
  }
  assert.equal(status, 413);
});

test("random bytes, truncated bodies, half headers", async () => {
  let seed = 12345;
  const rand = () => (seed = (seed * 1103515245 + 12345) & 0x7fffffff);
  const jobs = [];
  for (let i = 0; i < 20; i++) {
    const junk = Buffer.alloc(50 + (rand() % 2000));
    for (let k = 0; k < junk.length; k++) junk[k] = rand() & 0xff;
    jobs.push(rawExchange(junk, { waitMs: 500 }));
  }
  const body = JSON.stringify(reference);
  jobs.push(rawExchange(`POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ${body.length}\r\n\r\n${body.slice(0, 20)}`, { closeAfterSend: true }));
  jobs.push(rawExchange("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Len", { closeAfterSend: true }));
  jobs.push(rawExchange("GET / HTTP/1.1\r\n", { waitMs: 300 }));
  jobs.push(rawExchange(`POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n`, { waitMs: 500 }));
  jobs.push(rawExchange(`POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n`, { waitMs: 500 }));
  const answers = await Promise.all(jobs);
  for (const a of answers) if (a) assert.match(a, /^HTTP\/1\.1 \d{3}/, `garbage answer: ${a.slice(0, 80)}`);
});

test("a slow client that trickles its request still gets an answer", async () => {
  const body = JSON.stringify({ model: await modelName(), ...reference });
  const req = `POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`;
  const net = await import("node:net");
  const url = new URL(BASE_URL);
  const answer = await new Promise((resolve, reject) => {
    const sock = net.connect(Number(url.port), url.hostname);
    let got = "";
    sock.on("data", (d) => (got += d));
    sock.on("close", () => resolve(got));
    sock.on("error", reject);
    sock.on("connect", async () => {
      for (let i = 0; i < req.length; i += 40) {
        sock.write(req.slice(i, i + 40));
        await sleep(10);
      }
    });
  });
  assert.match(answer, /^HTTP\/1\.1 200/);
  assert.match(answer, /"finish_reason":"length"/);
});

test("slow readers and mid-stream disconnects", async () => {
  const model = await modelName();
  const body = JSON.stringify({ model, ...reference, max_tokens: 1000, stream: true });
  const req = `POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`;
  // Ten streams that read a few bytes and vanish, at different moments.
  await Promise.all(Array.from({ length: 10 }, (_, i) => rawExchange(req, { waitMs: 20 + i * 30 })));
  // SDK streams aborted after their first chunk.
  await Promise.all(
    Array.from({ length: 6 }, async () => {
      const ac = new AbortController();
      const stream = await sdk.chat.completions.create({ model, ...reference, max_tokens: 1000, stream: true }, { signal: ac.signal });
      try {
        for await (const _ of stream) {
          ac.abort();
        }
      } catch {}
    }),
  );
  await waitIdle(15_000);
});

test("afterwards: same answer as before, no capacity held", async () => {
  const after = await streamChat({ model: await modelName(), ...reference });
  assert.equal(after.reasoning, before.reasoning);
  assert.equal(after.content, before.content);
  const m = await waitIdle();
  assert.equal(m["kiln:kv_pages_used"], 0);
  assert.equal(m["kiln:num_running_reqs"], 0);
  assert.equal((await getJson("/health")).status, 200);
});
