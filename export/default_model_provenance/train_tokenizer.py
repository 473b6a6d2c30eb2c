"""Train the default model's byte-level BPE tokenizer on the training split, then tokenize every split.

Reads the corpus of build_corpus.py and writes

    OUT/tokenizer/tokenizer.json           byte-level BPE, 8192 ids: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2,
                                           then the 256 byte symbols, then the merges
    OUT/tokenizer/tokenizer_config.json    special tokens and a ChatML chat template (no default system prompt)
    OUT/tokenizer/special_tokens_map.json
    OUT/tokens/{train,valid,test}.npy      uint16 token ids: every document of the split in file order, each
                                           followed by <|endoftext|>
    OUT/tokens/token_bytes.npy             uint8 [vocab]: UTF-8 bytes each id stands for (0 for special tokens),
                                           so bits per byte = total NLL / ln 2 / sum(token_bytes[targets])
    OUT/tokens/stats.json                  tokens and bytes per split, unigram counts summary

The BPE trainer only sees training documents, with the ChatML control strings removed (they are special tokens,
never merged). Deterministic: same corpus, same `tokenizers` version, same output.

Usage: python export/default_model_provenance/train_tokenizer.py [--data .data/default_model] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOT_ID, IM_START_ID, IM_END_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def read_documents(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def stripped():
        for text in texts:
            for token in SPECIAL_TOKENS:
                text = text.replace(token, "\n")
            yield text

    tokenizer.train_from_iterator(stripped(), trainer, length=len(texts))
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, (token, tokenizer.token_to_id(token))
    return tokenizer


def tokenizer_config(max_length: int) -> dict:
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def token_byte_lengths(tokenizer) -> np.ndarray:
    """UTF-8 bytes each id stands for, 0 for special tokens.

    Byte-level BPE spells every byte as one character of `ByteLevel.alphabet()`, so a token's length in
    characters is its length in bytes.
    """
    from tokenizers import pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    lengths = np.zeros(tokenizer.get_vocab_size(), np.uint8)
    for token, idx in tokenizer.get_vocab().items():
        if token in SPECIAL_TOKENS:
            continue
        assert set(token) <= alphabet, token
        lengths[idx] = len(token)
    return lengths


def encode_split(tokenizer, texts: list[str]) -> np.ndarray:
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(EOT_ID)
    array = np.asarray(ids, dtype=np.uint16)
    assert int(array.max()) < tokenizer.get_vocab_size()
    return array


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=".data/default_model", type=Path)
    parser.add_argument("--vocab", default=8192, type=int)
    parser.add_argument("--max-length", default=1024, type=int, help="model_max_length in tokenizer_config.json")
    args = parser.parse_args()

    corpus = args.data / "corpus"
    splits = {s: read_documents(corpus / f"{s}.jsonl") for s in ("train", "valid", "test")}
    tokenizer = train_tokenizer(splits["train"], args.vocab)

    tok_dir = args.data / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(args.max_length), indent=2) + "\n")
    (tok_dir / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}, indent=2) + "\n")

    token_dir = args.data / "tokens"
    token_dir.mkdir(parents=True, exist_ok=True)
    token_bytes = token_byte_lengths(tokenizer)
    np.save(token_dir / "token_bytes.npy", token_bytes)
    stats = {"vocab_size": tokenizer.get_vocab_size(),
             "tokenizer_sha256": hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()}
    for split, texts in splits.items():
        ids = encode_split(tokenizer, texts)
        np.save(token_dir / f"{split}.npy", ids)
        text_bytes = sum(len(t.encode("utf-8")) for t in texts)
        stats[split] = {"documents": len(texts), "tokens": int(ids.size), "text_bytes": text_bytes,
                        "token_bytes": int(token_bytes[ids].sum(dtype=np.int64)),
                        "bytes_per_token": round(text_bytes / ids.size, 3)}
    (token_dir / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
