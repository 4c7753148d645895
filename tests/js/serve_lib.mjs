// Helpers for the `kiln serve` tests driven by tests/integration/serve_*.sh.
// Environment: KILN_URL (base URL), KILN_API_KEY (optional), KILN_MODEL_KIND (echo | hash | fixture |
// embedded: what the server runs, see tests/integration/lib/serve_lib.sh).
import net from "node:net";
import OpenAI from "openai";

export const BASE_URL = process.env.KILN_URL ?? "http://127.0.0.1:30000";
export const API_KEY = process.env.KILN_API_KEY ?? "";
export const MODEL_KIND = process.env.KILN_MODEL_KIND ?? "echo";

export function client(options = {}) {
  return new OpenAI({
    baseURL: `${BASE_URL}/v1`,
    apiKey: API_KEY || "none",
    maxRetries: 0,
    timeout: 120_000,
    ...options,
  });
}

let cachedModel = null;
export async function modelName() {
  if (!cachedModel) cachedModel = (await client().models.list()).data[0].id;
  return cachedModel;
}

export function authHeaders() {
  return API_KEY ? { Authorization: `Bearer ${API_KEY}` } : {};
}

export async function getJson(path) {
  const r = await fetch(`${BASE_URL}${path}`, { headers: authHeaders() });
  return { status: r.status, headers: r.headers, body: await r.text() };
}

export async function postRaw(path, body, headers = {}) {
  const r = await fetch(`${BASE_URL}${path}`, {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders(), ...headers },
    body: typeof body === "string" ? body : JSON.stringify(body),
  });
  const text = await r.text();
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {}
  return { status: r.status, headers: r.headers, text, json };
}

// Prometheus text -> {name: value} for unlabelled-by-us series (first sample of each name).
export async function metrics() {
  const r = await fetch(`${BASE_URL}/metrics`);
  const out = {};
  for (const line of (await r.text()).split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const name = line.slice(0, line.search(/[{ ]/));
    if (!(name in out)) out[name] = Number(line.slice(line.lastIndexOf(" ") + 1));
  }
  return out;
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Polls /metrics until KV pages and running / queued requests are all back to zero.
export async function waitIdle(limitMs = 10_000) {
  const deadline = Date.now() + limitMs;
  let m;
  while (Date.now() < deadline) {
    m = await metrics();
    if (m["kiln:kv_pages_used"] === 0 && m["kiln:num_running_reqs"] === 0 && m["kiln:num_queue_reqs"] === 0) return m;
    await sleep(50);
  }
  throw new Error(
    `server not idle after ${limitMs} ms: kv_pages_used=${m["kiln:kv_pages_used"]} running=${m["kiln:num_running_reqs"]} ` +
      `queued=${m["kiln:num_queue_reqs"]}`,
  );
}

// Streams a chat completion through the SDK and merges the deltas.
export async function streamChat(params, sdk = client()) {
  const stream = await sdk.chat.completions.create({ ...params, stream: true });
  const out = { reasoning: "", content: "", finish: null, usage: null, chunks: 0, toolCalls: [], role: null };
  for await (const chunk of stream) {
    out.chunks++;
    if (chunk.usage) out.usage = chunk.usage;
    for (const ch of chunk.choices) {
      const d = ch.delta ?? {};
      if (d.role) out.role = d.role;
      if (d.reasoning_content) out.reasoning += d.reasoning_content;
      if (d.content) out.content += d.content;
      for (const tc of d.tool_calls ?? []) {
        if (!out.toolCalls[tc.index]) out.toolCalls[tc.index] = { id: tc.id, name: tc.function?.name ?? "", arguments: "" };
        out.toolCalls[tc.index].arguments += tc.function?.arguments ?? "";
      }
      if (ch.finish_reason) out.finish = ch.finish_reason;
    }
  }
  return out;
}

// Sends raw bytes on a fresh TCP connection; resolves with whatever comes back before `waitMs` or close.
export function rawExchange(bytes, { waitMs = 1000, closeAfterSend = false } = {}) {
  const url = new URL(BASE_URL);
  return new Promise((resolve) => {
    const sock = net.connect(Number(url.port), url.hostname);
    let got = "";
    const done = () => {
      sock.destroy();
      resolve(got);
    };
    sock.on("connect", () => {
      sock.write(bytes);
      if (closeAfterSend) done();
    });
    sock.on("data", (d) => (got += d.toString("latin1")));
    sock.on("error", done);
    sock.on("close", done);
    setTimeout(done, waitMs);
  });
}
