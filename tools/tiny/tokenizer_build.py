"""Trains kiln-tiny's byte-level BPE tokenizer (HF `tokenizers`) the Qwen3.5 way and writes
tokenizer.json / tokenizer_config.json.

Same pipeline as Qwen3.5's tokenizer.json: NFC normaliser; pre-tokenizer Split(Qwen3.5 regex, isolated)
then ByteLevel (no prefix space, no regex); BPE without unk/byte-fallback; ByteLevel decoder and
post-processor. Digits are split one per token by the `\\p{N}` branch of the regex. The added tokens are
Qwen3.5's, with the same strings and order (ids follow the learned vocabulary instead of 248044+).
"""
import json
import re

QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
                  r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# (content, special) in Qwen3.5's order: 248044 <|endoftext|> ... 248069 </think>, then 248070-248076.
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
]

_SPECIAL_RE = re.compile("|".join(re.escape(t) for t, _ in ADDED_TOKENS))


def strip_added(text):
    """Text pieces between added tokens (BPE merges are learned from ordinary text only)."""
    return [p for p in _SPECIAL_RE.split(text) if p]


def pipeline_json():
    """An untrained tokenizer.json with Qwen3.5's pipeline (written as JSON, the form HF loads)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN35_PATTERN}, "behavior": "Isolated", "invert": False},
            dict(byte_level),
        ]},
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": {}, "merges": []},
    }


def train_tokenizer(texts, vocab_size):
    """texts: iterable of rendered conversations. Returns a tokenizers.Tokenizer whose BPE vocabulary
    has at most `vocab_size` entries (256 byte symbols included), followed by the added tokens."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers

    tok = Tokenizer.from_str(json.dumps(pipeline_json()))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])

    def pieces():
        for t in texts:
            yield from strip_added(t)

    tok.train_from_iterator(pieces(), trainer=trainer)
    # Added tokens go in as JSON too: ids right after the learned vocabulary, Qwen3.5's order.
    j = json.loads(tok.to_str())
    base = len(j["model"]["vocab"])
    j["added_tokens"] = [
        {"id": base + i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": special}
        for i, (content, special) in enumerate(ADDED_TOKENS)
    ]
    tok = Tokenizer.from_str(json.dumps(j))
    for i, (content, _) in enumerate(ADDED_TOKENS):
        got = tok.token_to_id(content)
        if got != base + i:
            raise RuntimeError(f"added token {content} got id {got}, expected {base + i}")
    return tok


def tokenizer_config(tok):
    """tokenizer_config.json contents (chat template lives in chat_template.jinja)."""
    decoder = {}
    for content, special in ADDED_TOKENS:
        decoder[str(tok.token_to_id(content))] = {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                                      "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
                                      "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                                      "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer(tok, out_dir):
    import os
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=True)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(tok), f, indent=2, ensure_ascii=False)
        f.write("\n")
