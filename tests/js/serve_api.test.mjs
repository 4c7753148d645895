// The OpenAI API of `kiln serve` through the official openai SDK.
//
// KILN_MODEL_KIND=echo: the server runs the echo dummy runner (the "model" repeats the user's last
// message, then ends its turn), so each test decides what the model writes and checks what the server
// and the SDK make of it: reasoning split, tool calls, stop strings, usage, logprobs.
// KILN_MODEL_KIND=embedded: the real kiln-tiny model; only behaviour a real model must show is checked.
import assert from "node:assert/strict";
import { test } from "node:test";
import OpenAI from "openai";
import { BASE_URL, MODEL_KIND, client, getJson, modelName, postRaw, streamChat, waitIdle } from "./serve_lib.mjs";

const echo = MODEL_KIND === "echo";
const sdk = client();
const user = (content) => [{ role: "user", content }];

test("GET /v1/models lists the served model", async () => {
  const list = await sdk.models.list();
  assert.equal(list.data.length, 1);
  assert.equal(list.data[0].object, "model");
  assert.equal(typeof list.data[0].id, "string");
  const one = await sdk.models.retrieve(list.data[0].id);
  assert.equal(one.id, list.data[0].id);
});

test("health, model info, server info", async () => {
  const h = await getJson("/health");
  assert.equal(h.status, 200);
  assert.equal(h.body, "");
  assert.equal((await getJson("/health_generate")).status, 200);
  for (const path of ["/get_model_info", "/model_info"]) {
    const info = JSON.parse((await getJson(path)).body);
    for (const key of ["model_path", "tokenizer_path", "is_generation", "model_type", "architectures", "weight_version"])
      assert.ok(key in info, `${path} lacks ${key}`);
    assert.equal(info.is_generation, true);
  }
  const si = JSON.parse((await getJson("/get_server_info")).body);
  assert.ok(si.context_length > 0);
  assert.ok(si.max_total_num_tokens > 0);
  assert.ok(si.max_running_requests > 0);
});

test("chat, not streamed: reasoning split, usage", { skip: !echo }, async () => {
  const said = "Two plus two.\nThat is 4.\n</think>\n\nThe answer is 4.";
  const r = await sdk.chat.completions.create({ model: await modelName(), messages: user(said), max_tokens: 200 });
  assert.equal(r.object, "chat.completion");
  assert.match(r.id, /^chatcmpl-/);
  const c = r.choices[0];
  assert.equal(c.message.role, "assistant");
  assert.equal(c.message.reasoning_content, "Two plus two.\nThat is 4.");
  assert.equal(c.message.content, "The answer is 4.");
  assert.equal(c.finish_reason, "stop");
  // One byte per token (the byte-level test tokenizer), plus the end-of-turn token.
  assert.equal(r.usage.completion_tokens, Buffer.byteLength(said) + 1);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
  assert.equal(r.usage.completion_tokens_details.reasoning_tokens, said.indexOf("</think>") + "</think>".length);
});

test("chat, streamed: the same text, role first, usage chunk last", { skip: !echo }, async () => {
  const said = "Let me see.\n</think>\n\nIt is blue.";
  const s = await streamChat({
    model: await modelName(),
    messages: user(said),
    stream_options: { include_usage: true },
  });
  assert.equal(s.role, "assistant");
  assert.equal(s.reasoning, "Let me see.");
  assert.equal(s.content, "It is blue.");
  assert.equal(s.finish, "stop");
  assert.ok(s.usage, "usage chunk");
  assert.equal(s.usage.completion_tokens, Buffer.byteLength(said) + 1);
  assert.equal(s.usage.completion_tokens_details.reasoning_tokens, said.indexOf("</think>") + 8);
  assert.ok(s.chunks >= 4, "role, reasoning, content, finish chunks");
});

test("thinking off: no reasoning, everything is content", { skip: !echo }, async () => {
  const params = {
    model: await modelName(),
    messages: user("Just the answer."),
    chat_template_kwargs: { enable_thinking: false },
  };
  const r = await sdk.chat.completions.create(params);
  assert.equal(r.choices[0].message.content, "Just the answer.");
  assert.equal(r.choices[0].message.reasoning_content ?? null, null);
  assert.equal(r.usage.completion_tokens_details.reasoning_tokens, 0);
  const s = await streamChat(params);
  assert.equal(s.content, "Just the answer.");
  assert.equal(s.reasoning, "");
});

test("generation that stops inside the think block: all reasoning, content empty", { skip: !echo }, async () => {
  const r = await sdk.chat.completions.create({ model: await modelName(), messages: user("thinking and thinking"), max_tokens: 8 });
  assert.equal(r.choices[0].message.reasoning_content, "thinking");
  assert.equal(r.choices[0].message.content, null);
  assert.equal(r.choices[0].finish_reason, "length");
});

test("separate_reasoning false returns the raw text", { skip: !echo }, async () => {
  const r = await sdk.chat.completions.create({
    model: await modelName(),
    messages: user("a\n</think>\n\nb"),
    separate_reasoning: false,
  });
  assert.equal(r.choices[0].message.content, "a\n</think>\n\nb");
});

const tools = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "Current weather",
      parameters: {
        type: "object",
        properties: { city: { type: "string" }, days: { type: "integer" }, metric: { type: "boolean" }, zip: { type: "string" } },
        required: ["city"],
      },
    },
  },
];
const toolText =
  "The user wants weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" +
  "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n" +
  "</function>\n</tool_call>";
const expectedArgs = { city: "Paris", days: 3, metric: false, zip: "75001" };

test("tool calls, not streamed", { skip: !echo }, async () => {
  const r = await sdk.chat.completions.create({ model: await modelName(), messages: user(toolText), tools });
  const c = r.choices[0];
  assert.equal(c.finish_reason, "tool_calls");
  assert.equal(c.message.reasoning_content, "The user wants weather.");
  assert.equal(c.message.content, null);
  assert.equal(c.message.tool_calls.length, 1);
  const call = c.message.tool_calls[0];
  assert.match(call.id, /^call_/);
  assert.equal(call.type, "function");
  assert.equal(call.function.name, "get_weather");
  assert.deepEqual(JSON.parse(call.function.arguments), expectedArgs);
});

test("tool calls, streamed (SDK stream helper assembles the deltas)", { skip: !echo }, async () => {
  const runner = sdk.chat.completions.stream({ model: await modelName(), messages: user(toolText), tools });
  const final = await runner.finalChatCompletion();
  const c = final.choices[0];
  assert.equal(c.finish_reason, "tool_calls");
  assert.equal(c.message.tool_calls.length, 1);
  assert.equal(c.message.tool_calls[0].function.name, "get_weather");
  assert.match(c.message.tool_calls[0].id, /^call_/);
  assert.deepEqual(JSON.parse(c.message.tool_calls[0].function.arguments), expectedArgs);
  // The same through our own delta merge.
  const s = await streamChat({ model: await modelName(), messages: user(toolText), tools });
  assert.equal(s.toolCalls.length, 1);
  assert.deepEqual(JSON.parse(s.toolCalls[0].arguments), expectedArgs);
  assert.equal(s.finish, "tool_calls");
});

test("tool_choice none: the XML stays text", { skip: !echo }, async () => {
  const r = await sdk.chat.completions.create({ model: await modelName(), messages: user(toolText), tools, tool_choice: "none" });
  assert.equal(r.choices[0].finish_reason, "stop");
  assert.ok(!r.choices[0].message.tool_calls);
  assert.match(r.choices[0].message.content, /<tool_call>/);
});

test("stop strings cut the text and never stream a partial stop string", { skip: !echo }, async () => {
  const params = { model: await modelName(), messages: user("x</think>one two STOP three"), stop: ["STOP"] };
  const r = await sdk.chat.completions.create(params);
  assert.equal(r.choices[0].message.content, "one two ");
  assert.equal(r.choices[0].finish_reason, "stop");
  const stream = await sdk.chat.completions.create({ ...params, stream: true });
  let text = "";
  for await (const chunk of stream)
    for (const ch of chunk.choices) {
      const piece = ch.delta?.content ?? "";
      assert.ok(!piece.includes("S"), `partial stop string streamed: ${JSON.stringify(piece)}`);
      text += piece;
    }
  assert.equal(text, "one two ");
});

test("max_tokens / max_completion_tokens give finish_reason length", { skip: !echo }, async () => {
  const r = await sdk.chat.completions.create({ model: await modelName(), messages: user("r</think>abcdefghij"), max_completion_tokens: 12 });
  assert.equal(r.choices[0].finish_reason, "length");
  assert.equal(r.usage.completion_tokens, 12);
  assert.equal(r.choices[0].message.content, "abc");
});

test("n > 1 gives independent choices", async () => {
  const r = await sdk.chat.completions.create({
    model: await modelName(),
    messages: user("r</think>same"),
    n: 3,
    max_tokens: 16,
    temperature: 0.8,
    seed: 7,
  });
  assert.equal(r.choices.length, 3);
  assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2]);
  if (echo) for (const c of r.choices) assert.equal(c.message.content, "same");
  const s = await sdk.chat.completions.create({ model: await modelName(), messages: user("r</think>xy"), n: 2, stream: true });
  const seen = new Set();
  for await (const chunk of s) for (const ch of chunk.choices) seen.add(ch.index);
  assert.deepEqual([...seen].sort(), [0, 1]);
});

test("chat logprobs", async () => {
  const r = await sdk.chat.completions.create({
    model: await modelName(),
    messages: user("r</think>ok"),
    logprobs: true,
    top_logprobs: 2,
    max_tokens: 16,
  });
  const lp = r.choices[0].logprobs.content;
  assert.equal(lp.length, r.usage.completion_tokens);
  for (const t of lp) {
    assert.equal(typeof t.token, "string");
    assert.ok(t.logprob <= 0);
    assert.ok(Array.isArray(t.bytes));
    assert.equal(t.top_logprobs.length, 2);
  }
});

test("text completions: string and token prompts, streamed and not, echo, logprobs", async () => {
  const model = await modelName();
  const prompt = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n";
  // temperature 0: the model's defaults sample (generation_config), and the streamed text must equal this one.
  const r = await sdk.completions.create({ model, prompt, max_tokens: 40, temperature: 0 });
  assert.equal(r.object, "text_completion");
  if (echo) {
    assert.equal(r.choices[0].text, "hello there");
    assert.equal(r.choices[0].finish_reason, "stop");
  }
  assert.ok(r.usage.prompt_tokens > 0);
  const tok = await postRaw("/tokenize", { prompt });
  const r2 = await sdk.completions.create({ model, prompt: tok.json.tokens, max_tokens: 4, logprobs: 3 });
  assert.equal(r2.choices[0].logprobs.tokens.length, 4);
  // {text: logprob}: alternatives that decode to the same text share a key (OpenAI's format).
  const top0 = Object.keys(r2.choices[0].logprobs.top_logprobs[0]);
  assert.ok(top0.length >= 1 && top0.length <= 3, JSON.stringify(top0));
  if (echo) assert.equal(r2.choices[0].text, "hell");
  const stream = await sdk.completions.create({ model, prompt, max_tokens: 40, temperature: 0, stream: true,
    stream_options: { include_usage: true } });
  let text = "";
  let usage = null;
  for await (const chunk of stream) {
    for (const c of chunk.choices) text += c.text;
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(text, r.choices[0].text);
  assert.equal(usage.completion_tokens, r.usage.completion_tokens);
  const e = await sdk.completions.create({ model, prompt, max_tokens: 2, echo: true });
  assert.ok(e.choices[0].text.startsWith(prompt));
});

test("text completions: a list of prompts gives n choices per prompt, in order (openai SDK)", async () => {
  const model = await modelName();
  const prompts = ["<|im_start|>user\nred<|im_end|>\n<|im_start|>assistant\n",
                   "<|im_start|>user\nblue sky<|im_end|>\n<|im_start|>assistant\n"];
  const alone = [];
  for (const prompt of prompts)
    alone.push((await sdk.completions.create({ model, prompt, max_tokens: 12, temperature: 0 })).choices[0].text);
  const r = await sdk.completions.create({ model, prompt: prompts, n: 2, max_tokens: 12, temperature: 0 });
  assert.equal(r.choices.length, 4);
  assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2, 3]);
  assert.deepEqual(r.choices.map((c) => c.text), [alone[0], alone[0], alone[1], alone[1]]);
  if (echo) assert.deepEqual(alone, ["red", "blue sky"]);
  const tok0 = (await postRaw("/tokenize", { prompt: prompts[0] })).json.tokens;
  const tok1 = (await postRaw("/tokenize", { prompt: prompts[1] })).json.tokens;
  assert.equal(r.usage.prompt_tokens, tok0.length + tok1.length);
  const ids = await sdk.completions.create({ model, prompt: [tok0, tok1], max_tokens: 12, temperature: 0 });
  assert.deepEqual(ids.choices.map((c) => c.text), alone);
});

test("logit_bias steers tokens; fields kiln does not implement are refused (openai SDK)", async () => {
  const model = await modelName();
  // A bias of 100 on one token id: every generated token is that one (the real model's logits are far smaller;
  // the echo runner's margin is 200, so there a negative bias on another token must leave the text unchanged).
  const t = await postRaw("/tokenize", { prompt: "Z" });
  const z = t.json.tokens[0];
  const prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
  if (!echo) {
    const r = await sdk.completions.create({ model, prompt, max_tokens: 4, temperature: 0,
      logit_bias: { [z]: 100 } });
    assert.equal(r.choices[0].text, "ZZZZ");
  }
  await assert.rejects(sdk.chat.completions.create({ model, messages: user("x"), logit_bias: { "-1": 5 } }), (e) => {
    assert.equal(e.status, 400);
    assert.equal(e.param, "logit_bias");
    return true;
  });
  await assert.rejects(sdk.chat.completions.create({ model, messages: user("x"),
    prediction: { type: "content", content: "x" } }), (e) => {
    assert.equal(e.status, 400);
    assert.equal(e.param, "prediction");
    assert.equal(e.code, "unsupported_parameter");
    return true;
  });
});

test("fields the SDK's clients send are accepted; reasoning_effort minimal turns thinking off (openai SDK)", async () => {
  const model = await modelName();
  const said = "Plain answer.";
  const r = await sdk.chat.completions.create({
    model, messages: user(said), max_tokens: 64, store: false, metadata: { team: "a" }, service_tier: "auto",
    prompt_cache_key: "k1", safety_identifier: "user-hash", verbosity: "low", reasoning_effort: "minimal",
  });
  assert.equal(r.choices[0].message.reasoning_content ?? null, null);
  if (echo) assert.equal(r.choices[0].message.content, said);
  const c = await sdk.completions.create({ model, prompt: "Once", max_tokens: 2, store: true, metadata: {},
    service_tier: "default", prompt_cache_key: "k2", safety_identifier: "s" });
  assert.equal(c.choices.length, 1);
});

test("the client's X-Request-Id comes back; min_tokens and continue_final_message (openai SDK)", async () => {
  const model = await modelName();
  const { data, response } = await sdk.chat.completions
    .create({ model, messages: user("hi"), max_tokens: 8 }, { headers: { "X-Request-Id": "sdk-trace-1" } })
    .withResponse();
  assert.equal(response.headers.get("x-request-id"), "sdk-trace-1");
  assert.match(data.id, /^chatcmpl-/);
  if (!echo) return;
  const off = { chat_template_kwargs: { enable_thinking: false } };
  const plain = await sdk.chat.completions.create({ model, messages: user("hi"), ...off });
  assert.equal(plain.usage.completion_tokens, 3);  // "h", "i", end of turn
  const held = await sdk.chat.completions.create({ model, messages: user("hi"), min_tokens: 6, ...off });
  assert.equal(held.usage.completion_tokens, 7);  // the end of turn held back until 6 tokens
  const messages = [...user("Say it."), { role: "assistant", content: "The answer is" }];
  const closed = await sdk.chat.completions.create({ model, messages, max_tokens: 1, add_generation_prompt: false });
  const open = await sdk.chat.completions.create({ model, messages, max_tokens: 1, continue_final_message: true });
  assert.equal(open.usage.prompt_tokens, closed.usage.prompt_tokens - 2);  // no "<|im_end|>\n"
});

test("tokenize / detokenize", async () => {
  const t = await postRaw("/tokenize", { prompt: "Hello" });
  assert.equal(t.status, 200);
  assert.equal(t.json.count, t.json.tokens.length);
  const d = await postRaw("/detokenize", { tokens: t.json.tokens });
  assert.equal(d.json.text, "Hello");
});

test("errors: OpenAI error objects with the right status and param", async () => {
  const model = await modelName();
  const cases = [
    [{ model, messages: user("x"), temperature: 5 }, 400, "temperature"],
    [{ model, messages: user("x"), top_p: 0 }, 400, "top_p"],
    [{ model, messages: user("x"), max_tokens: 0 }, 400, "max_tokens"],
    [{ model, messages: [] }, 400, "messages"],
    [{ model, messages: [{ role: "robot", content: "x" }] }, 400, "messages[0].role"],
    [{ model, messages: user("x"), n: -1 }, 400, "n"],
    [{ model, messages: user("x"), presence_penalty: 9 }, 400, "presence_penalty"],
  ];
  for (const [params, status, param] of cases) {
    await assert.rejects(sdk.chat.completions.create(params), (e) => {
      assert.ok(e instanceof OpenAI.APIError, String(e));
      assert.equal(e.status, status, JSON.stringify(params));
      assert.equal(e.param, param, JSON.stringify(params));
      assert.equal(e.type, "invalid_request_error");
      assert.ok(e.message.length > 0);
      return true;
    });
  }
  await assert.rejects(sdk.chat.completions.create({ model: "no-such-model", messages: user("x") }), (e) => {
    assert.ok(e instanceof OpenAI.NotFoundError);
    assert.equal(e.code, "model_not_found");
    return true;
  });
  const long = "word ".repeat(20000);
  await assert.rejects(sdk.chat.completions.create({ model, messages: user(long) }), (e) => {
    assert.equal(e.status, 400);
    assert.equal(e.code, "context_length_exceeded");
    assert.match(e.message, /\d+ tokens/);
    return true;
  });
  const bad = await postRaw("/v1/chat/completions", "{ not json");
  assert.equal(bad.status, 400);
  assert.ok(bad.json.error.message);
  await waitIdle();
});

test("a real model answers in both modes", { skip: MODEL_KIND !== "embedded" }, async () => {
  const model = await modelName();
  const think = await sdk.chat.completions.create({ model, messages: user("What is 12 + 7?"), max_tokens: 400, temperature: 0 });
  const m = think.choices[0].message;
  assert.ok(typeof m.reasoning_content === "string" && m.reasoning_content.length > 0, "reasoning in thinking mode");
  assert.ok(!/<\/?think>/.test(m.content ?? ""), "no think tags in content");
  assert.match(m.content ?? "", /19/, "kiln-tiny adds");
  const direct = await sdk.chat.completions.create({
    model,
    messages: user("What is 12 + 7?"),
    max_tokens: 64,
    temperature: 0,
    chat_template_kwargs: { enable_thinking: false },
  });
  assert.equal(direct.choices[0].message.reasoning_content ?? null, null);
  assert.match(direct.choices[0].message.content, /19/);
});

test(`server still idle and healthy at the end (${BASE_URL})`, async () => {
  await waitIdle();
  assert.equal((await getJson("/health")).status, 200);
});
