// Encode throughput of the HF tokenizers JS implementation, for comparison with kiln's
// (tests/js/tokenizer_bench.sh runs both on the same text). Writes the benchmark text to OUT_TEXT:
// the tokenizer corpus samples and seeded random strings (tokenizer_corpus.mjs), joined by newlines.
//
//   node tests/js/tokenize_bench.mjs TOKENIZER_DIR CORPUS_DIR OUT_TEXT [--reps N] [--random N] [--copies N] [--skip-whole]
// Times two ways: each line encoded on its own ("per line") and the whole text as one string.
import fs from "node:fs";
import { Tokenizer } from "@huggingface/tokenizers";
import { buildSamples, loadTokenizerFiles } from "./tokenizer_corpus.mjs";

const args = process.argv.slice(2);
if (args.length < 3) {
  console.error("usage: node tokenize_bench.mjs TOKENIZER_DIR CORPUS_DIR OUT_TEXT [--reps N] [--random N] [--copies N]");
  process.exit(2);
}
const [tokenizerDir, corpusDir, outText] = args;
const option = (name, fallback) => {
  const i = args.indexOf(name);
  return i >= 0 ? Number(args[i + 1]) : fallback;
};
const reps = option("--reps", 5);
const copies = option("--copies", 1);  // the whole sample set repeated, for a larger text

const { tokenizerJson, tokenizerConfig } = loadTokenizerFiles(tokenizerDir);
const tokenizer = new Tokenizer(tokenizerJson, tokenizerConfig);
const { samples } = buildSamples(corpusDir, option("--random", 3000), 12345);
const once = samples.map((s) => s.text).join("\n");
const text = Array(copies).fill(once).join("\n");
fs.writeFileSync(outText, text);
const bytes = Buffer.byteLength(text, "utf8");

// Two ways: the whole text as one string, and each sample (one line group) encoded on its own.
function timeRuns(encodeAll) {
  let tokens = 0;
  const seconds = [];
  for (let r = 0; r <= reps; r++) {  // the first run warms up the JIT and is not counted
    const start = process.hrtime.bigint();
    tokens = encodeAll();
    const s = Number(process.hrtime.bigint() - start) / 1e9;
    if (r > 0) seconds.push(s);
  }
  seconds.sort((a, b) => a - b);
  return { tokens, best: seconds[0], median: seconds[Math.floor(seconds.length / 2)] };
}
const report = (what, { tokens, best, median }) =>
  console.log(`js (@huggingface/tokenizers) ${what}: ${bytes} bytes, ${tokens} tokens; best ` +
    `${(bytes / best / 1e6).toFixed(2)} MB/s (${(tokens / best / 1e6).toFixed(3)} M tokens/s), median ` +
    `${(bytes / median / 1e6).toFixed(2)} MB/s over ${reps} runs`);
const pieces = text.split("\n");
report("per line", timeRuns(() => pieces.reduce((n, p) => n + tokenizer.encode(p).ids.length, 0)));
if (!args.includes("--skip-whole")) report("whole text", timeRuns(() => tokenizer.encode(text).ids.length));
