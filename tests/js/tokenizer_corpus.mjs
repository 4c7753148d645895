// The tokenizer test corpus as a list of samples, shared by tokenize_oracle.mjs and tokenize_bench.mjs.
// Samples: each .txt file of the corpus folder split at lines "---8<---", each whole file, one long
// text made of all files, and nRandom seeded random strings (same seed, same strings).
import fs from "node:fs";
import path from "node:path";

// mulberry32: a small seeded PRNG.
function makeRandom(seed) {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

export function buildSamples(corpusDir, nRandom, seed) {
  const random = makeRandom(seed);
  const pick = (array) => array[Math.floor(random() * array.length)];
  const randint = (lo, hi) => lo + Math.floor(random() * (hi - lo + 1));

  const samples = [];
  const files = fs.readdirSync(corpusDir).filter((f) => f.endsWith(".txt")).sort();
  let corpusBytes = 0;
  for (const file of files) {
    let text = fs.readFileSync(path.join(corpusDir, file), "utf8");
    corpusBytes += Buffer.byteLength(text, "utf8");
    if (text.endsWith("\n")) text = text.slice(0, -1);
    text.split("\n---8<---\n").forEach((s, i) => samples.push({ source: `${file}#${i}`, text: s }));
    samples.push({ source: `${file}(whole)`, text });
  }
  const allText = samples.filter((s) => s.source.endsWith("(whole)")).map((s) => s.text).join("\n\n");
  samples.push({ source: "long(all files x4)", text: [allText, allText, allText, allText].join("\n") });

  // Random strings from fragments: corpus words, code points of chosen ranges, whitespace, specials.
  const words = [...new Set(samples.flatMap((s) => s.text.split(/[ \n]/)).filter((w) => w.length > 0))];
  const ranges = [
    [0x20, 0x7e], [0xa0, 0xff], [0x100, 0x17f], [0x300, 0x36f], [0x370, 0x3ff], [0x400, 0x4ff],
    [0x590, 0x5ff], [0x600, 0x6ff], [0x900, 0x97f], [0xe00, 0xe7f], [0x1100, 0x11ff], [0x1e00, 0x1eff],
    [0x2000, 0x206f], [0x20a0, 0x20cf], [0x2100, 0x214f], [0x3000, 0x30ff], [0x4e00, 0x9fa5],
    [0xac00, 0xd7a3], [0xff00, 0xffef], [0x1f300, 0x1f64f], [0x1f900, 0x1f9ff],
  ];
  const fragments = [
    () => pick(words),
    () => " " + pick(words),
    () => {
      const [lo, hi] = pick(ranges);
      let s = "";
      for (let n = randint(1, 4); n > 0; n--) s += String.fromCodePoint(randint(lo, hi));
      return s;
    },
    () => pick([" ", "  ", "\t", "\n", "\r\n", "\n\n", "   \n", "\u00a0", "\u3000", "\u2028", "\u0085", "\u000b"]),
    () => pick(["'s", "'S", "'ll", "'LL", "'re", "'Ve", "'m", "'D", "'t", "'ſ", "n't"]),
    () => String(randint(0, 1e9)) + (random() < 0.3 ? "." + String(randint(0, 1e6)) : ""),
    () => pick(["\u0301", "\u0308", "\u0323", "\u200d", "\ufe0f", "\u093c", "\u05b0", "\u064e", "\u0e31", "\u11a8"]),
    () => pick(["👨‍👩‍👧", "🏳️‍🌈", "👍🏽", "🇯🇵", "1️⃣", "🤖", "😀"]),
    () => pick(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "<|im_", "<|fim_pad|>"]),
    () => pick(["{", "}", "(", ")", "[", "]", ";", "::", "->", "=>", "==", "!=", "//", "/*", "*/", "#", "$", "\\", "\"", "`"]),
  ];
  for (let i = 0; i < nRandom; i++) {
    let text = "";
    for (let n = randint(1, 40); n > 0; n--) text += pick(fragments)();
    samples.push({ source: `random#${i}`, text });
  }
  return { samples, files, corpusBytes, random, pick, randint };
}

export function loadTokenizerFiles(tokenizerDir) {
  const tokenizerJson = JSON.parse(fs.readFileSync(path.join(tokenizerDir, "tokenizer.json"), "utf8"));
  const configPath = path.join(tokenizerDir, "tokenizer_config.json");
  const tokenizerConfig = fs.existsSync(configPath) ? JSON.parse(fs.readFileSync(configPath, "utf8")) : {};
  return { tokenizerJson, tokenizerConfig };
}
