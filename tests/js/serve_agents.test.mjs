// The APIs coding agents speak, through the official SDKs: Anthropic Messages (@anthropic-ai/sdk:
// messages.create, streaming, a multi-turn tool-use loop, countTokens, errors) and OpenAI Responses (the openai
// SDK's responses.create / responses.stream: string input, streaming, function-call round trips by
// previous_response_id and by explicit items, json_schema output).
//
// KILN_MODEL_KIND=echo: the echo dummy runner repeats the user's last turn, so the texts are checked exactly.
// KILN_MODEL_KIND=embedded: kiln-tiny (17M parameters); only structure is checked: shapes, event order, ids, usage
// arithmetic, and that forced tool calls / json_schema answers parse as JSON valid against their schema (ajv).
import assert from "node:assert/strict";
import { test } from "node:test";
import Anthropic from "@anthropic-ai/sdk";
import Ajv from "ajv";
import { API_KEY, BASE_URL, MODEL_KIND, client, modelName, waitIdle } from "./serve_lib.mjs";

const echo = MODEL_KIND === "echo";
const anthropic = new Anthropic({ baseURL: BASE_URL, apiKey: API_KEY || "none", maxRetries: 0, timeout: 120_000 });
const openai = client();
const ajv = new Ajv({ strict: false, allErrors: true });

const WEATHER_SCHEMA = {
  type: "object",
  properties: { city: { type: "string", maxLength: 20 }, days: { type: "integer" } },
  required: ["city"],
  additionalProperties: false,
};
const validWeather = ajv.compile(WEATHER_SCHEMA);
const WEATHER_XML =
  "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n" +
  "</function>\n</tool_call>";
// What the user says: on the echo runner, the model's exact answer.
const say = (echoText, realText) => (echo ? echoText : realText);

function checkMessage(m) {
  assert.equal(m.type, "message");
  assert.equal(m.role, "assistant");
  assert.match(m.id, /^msg_/);
  assert.ok(Array.isArray(m.content));
  for (const b of m.content) assert.ok(["text", "thinking", "tool_use"].includes(b.type), `block type ${b.type}`);
  assert.ok(["end_turn", "max_tokens", "stop_sequence", "tool_use"].includes(m.stop_reason), m.stop_reason);
  for (const k of ["input_tokens", "output_tokens", "cache_read_input_tokens"])
    assert.ok(Number.isInteger(m.usage[k]) && m.usage[k] >= 0, `usage.${k}`);
  assert.ok(m.usage.output_tokens > 0);
}

// --- Anthropic Messages ---

test("messages.create: a text answer, usage against countTokens", async () => {
  const model = await modelName();
  const messages = [{ role: "user", content: say("Hello there.", "Say hello.") }];
  const m = await anthropic.messages.create({ model, max_tokens: 64, messages, system: "You are terse.", temperature: 0 });
  checkMessage(m);
  if (echo) {
    assert.deepEqual(m.content, [{ type: "text", text: "Hello there." }]);
    assert.equal(m.stop_reason, "end_turn");
    assert.equal(m.usage.output_tokens, "Hello there.".length + 1);
  }
  const count = await anthropic.messages.countTokens({ model, messages, system: "You are terse." });
  assert.equal(m.usage.input_tokens + m.usage.cache_read_input_tokens, count.input_tokens);
  const longer = await anthropic.messages.countTokens({ model, messages, system: "You are terse. And kind." });
  assert.ok(longer.input_tokens > count.input_tokens, "the system prompt is counted");
});

test("messages.stream: Anthropic's event sequence, and the SDK's final message", async () => {
  const model = await modelName();
  const stream = anthropic.messages.stream({
    model,
    max_tokens: echo ? 200 : 48,
    messages: [{ role: "user", content: say("Let me think.</think>\n\nIt is 4.", "What is 2 + 2?") }],
    thinking: { type: "enabled", budget_tokens: echo ? 100 : 32 },
  });
  const events = [];
  stream.on("streamEvent", (e) => events.push(e));
  const final = await stream.finalMessage();
  checkMessage(final);
  const types = events.map((e) => e.type);
  assert.equal(types[0], "message_start");
  assert.equal(types.at(-1), "message_stop");
  assert.equal(types.at(-2), "message_delta");
  // Every block: start, deltas of its own index, stop; blocks in index order, never interleaved.
  let open = -1;
  let next = 0;
  for (const e of events) {
    if (e.type === "content_block_start") {
      assert.equal(open, -1, "a block started inside another");
      assert.equal(e.index, next++);
      open = e.index;
    } else if (e.type === "content_block_delta") {
      assert.equal(e.index, open);
      assert.ok(["text_delta", "thinking_delta", "input_json_delta"].includes(e.delta.type));
    } else if (e.type === "content_block_stop") {
      assert.equal(e.index, open);
      open = -1;
    }
  }
  assert.equal(open, -1);
  assert.equal(final.content.length, next);
  if (echo) {
    assert.deepEqual(
      final.content.map((b) => [b.type, b.thinking ?? b.text]),
      [["thinking", "Let me think."], ["text", "It is 4."]],
    );
  }
});

test("tool use: a forced call, its result sent back, the next turn (multi-turn loop)", async () => {
  const model = await modelName();
  const tools = [{ name: "get_weather", description: "Current weather in a city", input_schema: WEATHER_SCHEMA }];
  const messages = [{ role: "user", content: say(WEATHER_XML, "What is the weather in Paris?") }];
  const first = await anthropic.messages.create({
    model,
    max_tokens: 200,
    messages,
    tools,
    tool_choice: { type: "tool", name: "get_weather" },
  });
  checkMessage(first);
  const calls = first.content.filter((b) => b.type === "tool_use");
  // The grammar bounds a call (a 20-character city, at most 15 digits, bounded whitespace): it fits 200 tokens.
  assert.equal(first.stop_reason, "tool_use");
  assert.equal(calls.length, 1);
  for (const c of calls) {
    assert.match(c.id, /^toolu_/);
    assert.equal(c.name, "get_weather");
    assert.ok(validWeather(c.input), `input fails the schema: ${JSON.stringify(c.input)} ${ajv.errorsText(validWeather.errors)}`);
  }
  if (echo) assert.deepEqual(calls[0].input, { city: "Paris", days: 3 });
  messages.push({ role: "assistant", content: first.content });
  messages.push({
    role: "user",
    content: [{ type: "tool_result", tool_use_id: calls[0].id, content: "22 C and sunny" }, { type: "text", text: "Thanks." }],
  });
  const second = await anthropic.messages.create({ model, max_tokens: 64, messages, tools, tool_choice: { type: "auto" } });
  checkMessage(second);
  if (echo) assert.equal(second.content.find((b) => b.type === "text")?.text, "Thanks.");
  // Forced again with "any": a call, valid against the schema.
  const third = await anthropic.messages.create({ model, max_tokens: 200, messages, tools, tool_choice: { type: "any" } });
  checkMessage(third);
  assert.equal(third.stop_reason, "tool_use");
  for (const c of third.content.filter((b) => b.type === "tool_use")) assert.ok(validWeather(c.input), JSON.stringify(c.input));
});

test("messages errors: Anthropic-shaped, mapped to the SDK's error classes", async () => {
  const model = await modelName();
  await assert.rejects(
    anthropic.messages.create({ model: "no-such-model", max_tokens: 8, messages: [{ role: "user", content: "x" }] }),
    (e) => e instanceof Anthropic.NotFoundError && e.status === 404 && e.error?.type === "error" &&
      e.error?.error?.type === "not_found_error",
  );
  await assert.rejects(
    anthropic.messages.create({ model, max_tokens: 8, temperature: 3, messages: [{ role: "user", content: "x" }] }),
    (e) => e instanceof Anthropic.BadRequestError && e.error?.error?.type === "invalid_request_error" &&
      /temperature/.test(e.error?.error?.message),
  );
});

// --- OpenAI Responses ---

function checkResponse(r) {
  assert.equal(r.object, "response");
  assert.match(r.id, /^resp_/);
  assert.ok(["completed", "incomplete"].includes(r.status), r.status);
  for (const item of r.output) assert.ok(["reasoning", "message", "function_call"].includes(item.type), item.type);
  const u = r.usage;
  assert.equal(u.total_tokens, u.input_tokens + u.output_tokens);
  assert.ok(u.input_tokens_details.cached_tokens <= u.input_tokens);
  assert.ok(u.output_tokens_details.reasoning_tokens <= u.output_tokens);
}

test("responses.create: string input, output items, usage", async () => {
  const model = await modelName();
  const r = await openai.responses.create({
    model,
    input: say("Fine.</think>\n\nBlue.", "What colour is the sky?"),
    instructions: "Answer in one word.",
    max_output_tokens: 64,
  });
  checkResponse(r);
  assert.equal(r.instructions, "Answer in one word.");
  if (echo) {
    assert.equal(r.output_text, "Blue.");
    assert.equal(r.output[0].type, "reasoning");
    assert.equal(r.output[0].content[0].text, "Fine.");
    assert.equal(r.usage.output_tokens, "Fine.</think>\n\nBlue.".length + 1);
    assert.equal(r.usage.output_tokens_details.reasoning_tokens, "Fine.</think>".length);
  }
});

test("responses.stream: created, items, deltas, completed; the SDK's final response", async () => {
  const model = await modelName();
  const stream = openai.responses.stream({
    model,
    input: say("Hmm.</think>\n\nSunny today.", "Weather?"),
    max_output_tokens: 48,
  });
  const types = [];
  stream.on("event", (e) => types.push(e.type));
  const final = await stream.finalResponse();
  checkResponse(final);
  assert.equal(types[0], "response.created");
  assert.ok(["response.completed", "response.incomplete"].includes(types.at(-1)));
  assert.ok(types.includes("response.output_item.added") && types.includes("response.output_item.done"));
  if (echo) {
    assert.ok(types.includes("response.output_text.delta"));
    assert.equal(final.output_text, "Sunny today.");
  }
});

const FUNCTION_TOOL = { type: "function", name: "get_weather", description: "Current weather in a city", parameters: WEATHER_SCHEMA, strict: true };

async function forcedCall(model, extra = {}) {
  const r = await openai.responses.create({
    model,
    input: say(WEATHER_XML, "What is the weather in Paris?"),
    tools: [FUNCTION_TOOL],
    tool_choice: { type: "function", name: "get_weather" },
    max_output_tokens: 300,
    reasoning: { effort: "none" },  // thinking off: the constrained call comes at once
    ...extra,
  });
  checkResponse(r);
  const calls = r.output.filter((i) => i.type === "function_call");
  assert.equal(r.status, "completed");
  assert.equal(calls.length, 1, "a forced call (the grammar bounds it well within max_output_tokens)");
  for (const c of calls) {
    assert.match(c.call_id, /^call_/);
    assert.equal(c.name, "get_weather");
    const args = JSON.parse(c.arguments);
    assert.ok(validWeather(args), `arguments fail the schema: ${c.arguments}`);
  }
  if (echo) assert.deepEqual(JSON.parse(calls[0].arguments), { city: "Paris", days: 3 });
  return { r, call: calls[0] };
}

test("function call round trip by previous_response_id", async () => {
  const model = await modelName();
  const { r, call } = await forcedCall(model);
  const next = await openai.responses.create({
    model,
    previous_response_id: r.id,
    input: [{ type: "function_call_output", call_id: call.call_id, output: "22 C and sunny" }],
    tools: [FUNCTION_TOOL],
    max_output_tokens: 64,
  });
  checkResponse(next);
  assert.equal(next.previous_response_id, r.id);
  assert.ok(next.usage.input_tokens > r.usage.input_tokens, "the stored conversation is part of the prompt");
  await assert.rejects(
    openai.responses.create({ model, previous_response_id: "resp_unknown", input: "x" }),
    (e) => e.status === 404 && e.code === "previous_response_not_found",
  );
});

test("function call round trip by explicit items (store false)", async () => {
  const model = await modelName();
  const { r, call } = await forcedCall(model, { store: false });
  assert.equal(r.store, false);
  const input = [
    { role: "user", content: "What is the weather in Paris?" },
    ...r.output,
    { type: "function_call_output", call_id: call.call_id, output: say("It is 22 C.", "22 C and sunny") },
  ];
  const next = await openai.responses.create({ model, input, tools: [FUNCTION_TOOL], max_output_tokens: 64, store: false });
  checkResponse(next);
  await assert.rejects(openai.responses.create({ model, previous_response_id: r.id, input: "x" }), (e) => e.status === 404);
});

test("text.format json_schema: the answer is JSON valid against the schema", async () => {
  const model = await modelName();
  const schema = { type: "object", properties: { colour: { type: "string", enum: ["red", "green", "blue"] } }, required: ["colour"], additionalProperties: false };
  const r = await openai.responses.create({
    model,
    input: say('{"colour": "blue"}', "What colour is the sky? Answer in JSON."),
    text: { format: { type: "json_schema", name: "colour", schema, strict: true } },
    reasoning: { effort: "none" },
    max_output_tokens: 64,
  });
  checkResponse(r);
  assert.equal(r.status, "completed", "the enum bounds the answer well within max_output_tokens");
  const v = JSON.parse(r.output_text);
  assert.ok(ajv.validate(schema, v), r.output_text);
});

test(`server still idle at the end (${BASE_URL})`, async () => {
  await waitIdle();
});
