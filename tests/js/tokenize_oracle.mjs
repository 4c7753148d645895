// Oracle for kiln's tokenizer: encodes a corpus with the HF tokenizers JS implementation
// (@huggingface/tokenizers) and writes the expected results as JSON lines.
//
//   node tests/js/tokenize_oracle.mjs TOKENIZER_DIR CORPUS_DIR OUT.jsonl [--random N] [--seed S] [--no-decode]
//
// Lines written:
//   {"kind":"encode","source":...,"text":...,"ids":[...],"nfc":...,"decoded":...}
//       ids: encode(text) (special tokens parsed); nfc: text.normalize("NFC"); decoded: decode(ids)
//   {"kind":"decode","ids":[...],"text":...,"text_skip_special":...}
//       decode of random id sequences (split multi-byte characters, special tokens)
// --no-decode: encode lines only (the decode cases assume Qwen3's ids: every byte has its token).
// Samples: each corpus .txt file split at lines "---8<---", each whole file, one long text made of
// all files, and N seeded random strings (deterministic: same seed, same strings).
import fs from "node:fs";
import { Tokenizer } from "@huggingface/tokenizers";
import { buildSamples, loadTokenizerFiles } from "./tokenizer_corpus.mjs";

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
const seed = option("--seed", 12345);

const { tokenizerJson, tokenizerConfig } = loadTokenizerFiles(tokenizerDir);
const tokenizer = new Tokenizer(tokenizerJson, tokenizerConfig);
const { samples, files, corpusBytes, random, pick, randint } = buildSamples(corpusDir, nRandom, seed);

const out = fs.createWriteStream(outPath);
for (const { source, text } of samples) {
  const ids = tokenizer.encode(text).ids;
  // decode([]) throws: a text of dropped bytes only (a vocabulary without some bytes and no unk_token) decodes to "".
  const decoded = ids.length ? tokenizer.decode(ids) : "";
  const line = { kind: "encode", source, text, ids, nfc: text.normalize("NFC"), decoded };
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
const nDecode = args.includes("--no-decode") ? 0 : Math.max(200, Math.floor(nRandom / 5));
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
