// Oracle check of a covering tokenizer (kiln dummy-checkpoint): HF tokenizers JS loads it, decodes every id
// of the vocabulary to non-empty text, and encodes the texts of TEXTS.jsonl to the ids kiln gave (KILN.jsonl).
//
//   node tests/js/covering_tokenizer_check.mjs TOKENIZER_DIR VOCAB_SIZE TEXTS.jsonl KILN.jsonl
import fs from "node:fs";
import { Tokenizer } from "@huggingface/tokenizers";
import { loadTokenizerFiles } from "./tokenizer_corpus.mjs";

const [dir, vocabArg, textsPath, kilnPath] = process.argv.slice(2);
const { tokenizerJson, tokenizerConfig } = loadTokenizerFiles(dir);
const tokenizer = new Tokenizer(tokenizerJson, tokenizerConfig);
const read = (p) => fs.readFileSync(p, "utf8").split("\n").filter(Boolean).map(JSON.parse);
let passed = 0, failed = 0;
const vocab = Number(vocabArg);
let empty = 0;
for (let id = 0; id < vocab; ++id) if (tokenizer.decode([id]) === "") ++empty;
if (empty) { console.log(`FAIL: ${empty} of ${vocab} ids decode to nothing in HF tokenizers`); failed++; } else passed++;
const texts = read(textsPath), kiln = read(kilnPath);
texts.forEach((t, i) => {
  const js = tokenizer.encode(t).ids;
  if (JSON.stringify(js) === JSON.stringify(kiln[i])) { passed++; return; }
  if (++failed <= 5) console.log(`FAIL ${JSON.stringify(t)}\n kiln ${JSON.stringify(kiln[i])}\n js   ${JSON.stringify(js)}`);
});
console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
