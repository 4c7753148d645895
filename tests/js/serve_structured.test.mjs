// Constrained decoding of `kiln serve` on a real model (kiln-tiny, or the random-weight fixture model):
// response_format json_object / json_schema and tool_choice required / named, sampled at temperature 1,
// streamed and not, n > 1. Every output that ends with finish_reason "stop" (or "tool_calls") is checked by an
// outside validator (ajv, JSON Schema draft 2020-12 semantics for the keywords used); most outputs must end
// that way (the rest hit max_tokens). Unsupported schema keywords must be a 400 naming the keyword. SGLang's
// regex / ebnf fields likewise, checked with JavaScript's RegExp.
import assert from "node:assert/strict";
import { test } from "node:test";
import Ajv from "ajv";
import { client, modelName, postRaw } from "./serve_lib.mjs";

const sdk = client();
const ajv = new Ajv({ strict: false, allErrors: true });
const user = (content) => [{ role: "user", content }];
const ROUNDS = Number(process.env.KILN_STRUCTURED_ROUNDS ?? 3);

// Non-streamed: every choice's {text, finish}.
async function sample(params) {
  const r = await sdk.chat.completions.create({ model: await modelName(), temperature: 1, ...params });
  return r.choices.map((c) => ({ text: c.message.content ?? "", finish: c.finish_reason, calls: c.message.tool_calls ?? [] }));
}

// Streamed with n choices: accumulated per choice index.
async function sampleStream(params) {
  const stream = await sdk.chat.completions.create({ model: await modelName(), temperature: 1, ...params, stream: true });
  const out = [];
  for await (const chunk of stream)
    for (const ch of chunk.choices) {
      const o = (out[ch.index] ??= { text: "", finish: null, calls: [] });
      if (ch.delta?.content) o.text += ch.delta.content;
      for (const tc of ch.delta?.tool_calls ?? []) {
        o.calls[tc.index] ??= { function: { name: "", arguments: "" } };
        if (tc.function?.name) o.calls[tc.index].function.name += tc.function.name;
        o.calls[tc.index].function.arguments += tc.function?.arguments ?? "";
      }
      if (ch.finish_reason) o.finish = ch.finish_reason;
    }
  return out;
}

// minFraction: the share of outputs that must finish (free-form objects may grow until max_tokens on a small model).
function checkJson(outputs, validate, what, minFraction = 0.5) {
  let done = 0;
  for (const o of outputs) {
    if (o.finish !== "stop") continue;
    done++;
    let v;
    assert.doesNotThrow(() => (v = JSON.parse(o.text)), `${what}: not JSON: ${JSON.stringify(o.text)}`);
    assert.ok(validate(v), `${what}: ${JSON.stringify(o.text)} fails the schema: ${ajv.errorsText(validate.errors)}`);
  }
  assert.ok(done >= Math.max(1, Math.ceil(minFraction * outputs.length)), `${what}: only ${done} of ${outputs.length} outputs finished`);
}

const FREE_FORM = new Set(["string_map"]);

const SCHEMAS = {
  object_features: {
    type: "object",
    properties: {
      name: { type: "string", minLength: 2, maxLength: 12 },
      age: { type: "integer" },
      score: { type: "number" },
      ok: { type: "boolean" },
      none: { type: "null" },
      kind: { enum: ["cat", "dog", 7, null] },
      fixed: { const: "v1" },
      note: { type: "string", maxLength: 8 },
    },
    required: ["name", "age", "ok", "kind", "fixed"],
    additionalProperties: false,
  },
  arrays_anyof: {
    type: "object",
    properties: {
      list: { type: "array", items: { type: "integer" }, minItems: 1, maxItems: 3 },
      mixed: { type: "array", items: { anyOf: [{ type: "boolean" }, { type: "string", maxLength: 4 }] }, maxItems: 2 },
      pair: { type: ["integer", "null"] },
    },
    required: ["list", "mixed", "pair"],
    additionalProperties: false,
  },
  refs_defs: {
    $defs: { point: { type: "object", properties: { x: { type: "integer" }, y: { type: "integer" } }, required: ["x", "y"], additionalProperties: false } },
    type: "object",
    properties: { a: { $ref: "#/$defs/point" }, b: { type: "array", items: { $ref: "#/$defs/point" }, maxItems: 2 } },
    required: ["a", "b"],
  },
  string_map: { type: "object", additionalProperties: { type: "string", maxLength: 6 }, title: "annotations are ignored" },
};

test("response_format json_object: every finished output is a JSON object (n=3, streamed and not)", async () => {
  const validate = ajv.compile({ type: "object" });
  const all = [];
  for (let i = 0; i < ROUNDS; i++) {
    const params = { messages: user("Reply in JSON."), max_tokens: 400, n: 3, response_format: { type: "json_object" } };
    all.push(...(await sample(params)), ...(await sampleStream(params)));
  }
  checkJson(all, validate, "json_object", 0.1);
});

for (const [name, schema] of Object.entries(SCHEMAS)) {
  test(`response_format json_schema ${name}: finished outputs validate (n=3, streamed and not)`, async () => {
    const validate = ajv.compile(schema);
    const all = [];
    for (let i = 0; i < ROUNDS; i++) {
      const params = {
        messages: user("Fill the form."),
        max_tokens: 500,
        n: 3,
        response_format: { type: "json_schema", json_schema: { name, schema, strict: true } },
      };
      all.push(...(await sample(params)), ...(await sampleStream(params)));
    }
    checkJson(all, validate, name, FREE_FORM.has(name) ? 0.1 : 0.5);
  });
}

test("json_schema with thinking off: the answer starts constrained at once", async () => {
  const validate = ajv.compile(SCHEMAS.object_features);
  const outs = await sample({
    messages: user("Fill the form."),
    max_tokens: 400,
    n: 3,
    chat_template_kwargs: { enable_thinking: false },
    response_format: { type: "json_schema", json_schema: { name: "f", schema: SCHEMAS.object_features } },
  });
  checkJson(outs, validate, "no thinking");
});

test("/v1/completions with response_format json_object", async () => {
  const validate = ajv.compile({ type: "object" });
  // A small model often runs an open object to max_tokens: up to three rounds of 12 samples, until one finishes (every
  // finished output is checked; at least one of them must have finished).
  const outs = [];
  for (let round = 0; round < 3 && !outs.some((o) => o.finish === "stop"); round++) {
    const r = await postRaw("/v1/completions", {
      model: await modelName(), prompt: "Data:", max_tokens: 400, n: 12, temperature: 1, response_format: { type: "json_object" },
    });
    assert.equal(r.status, 200, r.text);
    outs.push(...r.json.choices.map((c) => ({ text: c.text, finish: c.finish_reason })));
  }
  checkJson(outs, validate, "completions", 1 / outs.length);
});

test("unsupported or invalid schemas are a 400 naming the keyword", async () => {
  for (const [schema, word] of [
    [{ type: "string", not: { const: "a" } }, "'not'"],
    [{ type: "object", patternProperties: { "^x": { type: "integer" } } }, "'patternProperties'"],
    [{ type: "object", properties: { n: { type: "number", minimum: 0.5 } } }, "'minimum'"],
    [{ type: "string", format: "no-such-format" }, "'no-such-format'"],
    [{ $ref: "#/$defs/nope" }, "#/$defs/nope"],
  ]) {
    const r = await postRaw("/v1/chat/completions", {
      model: await modelName(), messages: user("x"), response_format: { type: "json_schema", json_schema: { name: "s", schema } },
    });
    assert.equal(r.status, 400, r.text);
    assert.equal(r.json.error.param, "response_format");
    assert.ok(r.json.error.message.includes(word), r.json.error.message);
  }
  const bad = await postRaw("/v1/chat/completions", { model: await modelName(), messages: user("x"), response_format: { type: "yaml" } });
  assert.equal(bad.status, 400);
  assert.ok(bad.json.error.message.includes("yaml"));
});

// SGLang's regex / ebnf fields: every finished output must match, checked by JavaScript's own RegExp engine (for
// the EBNF grammar, by a RegExp written independently for the same language).
test("regex and ebnf: finished outputs match (chat without thinking, completions)", async () => {
  const cases = [
    { field: { regex: "[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]*)?" }, re: /^[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]*)?$/ },
    { field: { regex: "(yes|no|maybe), because [a-z ]{1,20}\\." }, re: /^(yes|no|maybe), because [a-z ]{1,20}\.$/ },
    {
      field: { ebnf: 'root ::= "(" num (op num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}\nop ::= " + " | " * "' },
      re: /^\([1-9][0-9]{0,2}(( \+ | \* )[1-9][0-9]{0,2}){0,3}\)$/,
    },
  ];
  for (const { field, re } of cases) {
    const chat = await postRaw("/v1/chat/completions", {
      model: await modelName(), messages: user("Answer."), max_tokens: 60, n: 3, temperature: 1,
      chat_template_kwargs: { enable_thinking: false }, ...field,
    });
    assert.equal(chat.status, 200, chat.text);
    const comp = await postRaw("/v1/completions", {
      model: await modelName(), prompt: "Answer:", max_tokens: 60, n: 3, temperature: 1, ...field,
    });
    assert.equal(comp.status, 200, comp.text);
    const outs = [
      ...chat.json.choices.map((c) => ({ text: c.message.content ?? "", finish: c.finish_reason })),
      ...comp.json.choices.map((c) => ({ text: c.text, finish: c.finish_reason })),
    ];
    const done = outs.filter((o) => o.finish === "stop");
    assert.ok(done.length >= 3, `${JSON.stringify(field)}: only ${done.length} of ${outs.length} finished`);
    for (const o of done) assert.match(o.text, re, JSON.stringify(field));
  }
});

test("regex / ebnf errors: bad syntax, two constraints at once, with forced tools", async () => {
  const base = { model: await modelName(), messages: user("x"), max_tokens: 8 };
  for (const [extra, param, word] of [
    [{ regex: "(?=a)b" }, "regex", "regex"],
    [{ regex: 7 }, "regex", "string"],
    [{ ebnf: "root ::= missing" }, "ebnf", "missing"],
    [{ regex: "a+", ebnf: 'root ::= "a"' }, "regex", "at most one"],
    [{ regex: "a+", response_format: { type: "json_object" } }, "regex", "at most one"],
  ]) {
    const r = await postRaw("/v1/chat/completions", { ...base, ...extra });
    assert.equal(r.status, 400, `${JSON.stringify(extra)}: ${r.text}`);
    assert.equal(r.json.error.param, param, r.text);
    assert.ok(r.json.error.message.includes(word), r.json.error.message);
  }
  const tools = [{ type: "function", function: { name: "f", parameters: { type: "object", properties: {} } } }];
  const r = await postRaw("/v1/chat/completions", { ...base, regex: "a+", tools, tool_choice: "required" });
  assert.equal(r.status, 400, r.text);
  assert.equal(r.json.error.param, "regex");
});

const TOOLS = [
  {
    type: "function",
    function: {
      name: "get_weather",
      parameters: {
        type: "object",
        properties: { city: { type: "string", minLength: 1, maxLength: 16 }, days: { type: "integer" }, unit: { type: "string", enum: ["c", "f"] } },
        required: ["city", "days"],
      },
    },
  },
  {
    type: "function",
    function: {
      name: "set_alarm",
      parameters: {
        type: "object",
        properties: { hour: { type: "integer" }, loud: { type: "boolean" }, tags: { type: "array", items: { type: "string", maxLength: 5 }, maxItems: 2 } },
        required: ["hour", "loud"],
      },
    },
  },
];
const TOOL_VALIDATORS = Object.fromEntries(TOOLS.map((t) => [t.function.name, ajv.compile(t.function.parameters)]));

function checkCalls(outputs, allowed, what) {
  let done = 0;
  for (const o of outputs) {
    if (o.finish !== "tool_calls" && o.finish !== "stop") continue;
    done++;
    assert.ok(o.calls.length >= 1, `${what}: no tool call in ${JSON.stringify(o)}`);
    for (const c of o.calls) {
      assert.ok(allowed.includes(c.function.name), `${what}: call of ${c.function.name}`);
      let args;
      assert.doesNotThrow(() => (args = JSON.parse(c.function.arguments)), `${what}: arguments ${c.function.arguments}`);
      const v = TOOL_VALIDATORS[c.function.name];
      assert.ok(v(args), `${what}: ${c.function.arguments} fails ${c.function.name}: ${ajv.errorsText(v.errors)}`);
    }
  }
  assert.ok(done * 2 >= outputs.length, `${what}: only ${done} of ${outputs.length} outputs finished`);
}

test("tool_choice required: a valid call of an allowed function (n=3, streamed and not)", async () => {
  for (let i = 0; i < ROUNDS; i++) {
    const params = { messages: user("What is the weather in Paris?"), tools: TOOLS, tool_choice: "required", max_tokens: 400, n: 3 };
    checkCalls(await sample(params), ["get_weather", "set_alarm"], "required");
    checkCalls(await sampleStream(params), ["get_weather", "set_alarm"], "required stream");
  }
});

test("tool_choice named: a valid call of exactly that function, one call", async () => {
  for (let i = 0; i < ROUNDS; i++) {
    const params = {
      messages: user("What is the weather in Paris?"), tools: TOOLS, max_tokens: 400, n: 3,
      tool_choice: { type: "function", function: { name: "set_alarm" } },
    };
    for (const outs of [await sample(params), await sampleStream(params)]) {
      checkCalls(outs, ["set_alarm"], "named");
      for (const o of outs) if (o.finish !== "length") assert.equal(o.calls.length, 1);
    }
  }
});

test("tool_choice errors: a named function not in tools, required without tools", async () => {
  const r1 = await postRaw("/v1/chat/completions", {
    model: await modelName(), messages: user("x"), tools: TOOLS, tool_choice: { type: "function", function: { name: "nope" } },
  });
  assert.equal(r1.status, 400, r1.text);
  assert.ok(r1.json.error.message.includes("nope"));
  const r2 = await postRaw("/v1/chat/completions", { model: await modelName(), messages: user("x"), tool_choice: "required" });
  assert.equal(r2.status, 400, r2.text);
});
