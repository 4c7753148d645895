// Oracle for kiln's tokenizer: encodes a corpus with the HF tokenizers JS implementation
// (@huggingface/tokenizers) and writes the expected results as JSON lines.
//
//   node tests/js/tokenize_oracle.mjs TOKENIZER_DIR CORPUS_DIR OUT.jsonl [--random N] [--seed S]
//
// Lines written:
//   {"kind":"encode","source":...,"text":...,"ids":[...],"nfc":...,"decoded":...}
//       ids: encode(text) (special tokens parsed); nfc: text.normalize("NFC"); decoded: decode(ids)
//   {"kind":"decode","ids":[...],"text":...,"text_skip_special":...}
//       decode of random id sequences (split multi-byte characters, special tokens)
// Samples: each corpus .txt file split at lines "---8<---", each whole file, one long text made of
// all files, and N seeded random strings (deterministic: same seed, same strings).
import fs from "node:fs";
import path from "node:path";
import { Tokenizer } from "@huggingface/tokenizers";

const args = process.argv.slice(2);
if (args.length < 3) {
  console.error("usage: node tokenize_oracle.mjs TOKENIZER_DIR CORPUS_DIR OUT.jsonl [--random N] [--seed S]");
  process.exit(2);
}
const [tokenizerDir, corpusDir, outPath] = args;
const option = (name, fallback) => {
  const i = args.indexOf(name);
  return i >= 0 ? Number(args[i + 1]) : fallback;
};
const nRandom = option("--random", 3000);
let seed = option("--seed", 12345) >>> 0;

const tokenizerJson = JSON.parse(fs.readFileSync(path.join(tokenizerDir, "tokenizer.json"), "utf8"));
const configPath = path.join(tokenizerDir, "tokenizer_config.json");
const tokenizerConfig = fs.existsSync(configPath) ? JSON.parse(fs.readFileSync(configPath, "utf8")) : {};
const tokenizer = new Tokenizer(tokenizerJson, tokenizerConfig);

// mulberry32: a small seeded PRNG.
function random() {
  seed = (seed + 0x6d2b79f5) >>> 0;
  let t = seed;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const pick = (array) => array[Math.floor(random() * array.length)];
const randint = (lo, hi) => lo + Math.floor(random() * (hi - lo + 1));

// Corpus samples.
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

const out = fs.createWriteStream(outPath);
for (const { source, text } of samples) {
  const ids = tokenizer.encode(text).ids;
  const line = { kind: "encode", source, text, ids, nfc: text.normalize("NFC"), decoded: tokenizer.decode(ids) };
  out.write(JSON.stringify(line) + "\n");
}

// Decode cases: random id sequences that split multi-byte characters and mix in special tokens.
const vocabSize = 151643;
const specialIds = [151643, 151644, 151645, 151657, 151667, 151668];
// The ids of single-byte tokens: the byte-level alphabet maps byte b to one character.
const byteLevel = (b) => {
  const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
  if (printable) return String.fromCodePoint(b);
  let n = 0;
  for (let x = 0; x < b; x++) {
    const p = (x >= 0x21 && x <= 0x7e) || (x >= 0xa1 && x <= 0xac) || (x >= 0xae && x <= 0xff);
    if (!p) n++;
  }
  return String.fromCodePoint(256 + n);
};
const singleByteId = (b) => tokenizer.token_to_id(byteLevel(b));
const nDecode = Math.max(200, Math.floor(nRandom / 5));
for (let i = 0; i < nDecode; i++) {
  const ids = [];
  for (let n = randint(1, 20); n > 0; n--) {
    const r = random();
    if (r < 0.4) ids.push(randint(0, vocabSize - 1));
    else if (r < 0.8) ids.push(singleByteId(randint(0x80, 0xff)));
    else if (r < 0.9) ids.push(pick(specialIds));
    else ids.push(singleByteId(randint(0x20, 0x7e)));
  }
  const line = {
    kind: "decode", ids,
    text: tokenizer.decode(ids),
    text_skip_special: tokenizer.decode(ids, { skip_special_tokens: true }),
  };
  out.write(JSON.stringify(line) + "\n");
}
out.end();
out.on("finish", () => {
  console.error(`tokenize_oracle: ${samples.length} encode samples (corpus files ${corpusBytes} bytes, ` +
    `${files.length} files), ${nDecode} decode cases -> ${outPath}`);
});
