"""Shared session fixtures: a tiny byte-level BPE tokenizer with a ChatML template and a tiny exported model."""

from __future__ import annotations

import importlib
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from tiny_models import build_hf_model

SPECIAL_TOKENS = ("<|pad|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2: the tiny models' pad, bos and eos
TOKENIZER_VOCAB_SIZE = 384
MAX_POSITIONS = 2048  # room for long generations (drain and disconnect tests)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# English, CJK and emoji, so the vocabulary holds whole multi-byte characters and pieces of them.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, streaming tokens one by one!",
    "Mixture of experts models route every token to a few experts; the rest stay on the disk.",
    "你好，世界。今天天气很好。我们一起学习中文。专家模型",
    "こんにちは世界、ありがとう",
    "🙂😀🚀🌍 emoji 🎉 party 🐍 python ✨",
]


def write_tokenizer(folder: str | Path, corpus: list[str] = _CORPUS, special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
                    chat_template: str = CHATML_TEMPLATE) -> None:
    """Train a byte-level BPE tokenizer (in memory, no network) and save it with a chat template (ChatML unless
    given); `special_tokens` start the vocabulary (the first three: pad, bos and eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus * 4, trainer)
    folder = Path(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"pad_token": special_tokens[0], "eos_token": special_tokens[2], "chat_template": chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mixtral exported to a native fp32 model folder with the tokenizer above (built once per session)."""
    from colibri_stream.export import export_model

    hf_dir = tmp_path_factory.mktemp("hf_tiny_mixtral")
    build_hf_model("mixtral", hf_dir, vocab_size=TOKENIZER_VOCAB_SIZE, max_position_embeddings=MAX_POSITIONS)
    out_dir = tmp_path_factory.mktemp("models") / "tiny-mixtral"
    export_model(hf_dir, out_dir, dtype="fp32", progress=False)
    write_tokenizer(out_dir)
    return out_dir


def linked_model(model_dir: Path, folder: Path, leave_out: str = "tokenizer") -> Path:
    """`folder`, new, holding links to `model_dir`'s files but those whose names start with `leave_out` (the
    tokenizer's, by default: the caller writes its own)."""
    folder.mkdir()
    for path in model_dir.iterdir():
        if not path.name.startswith(leave_out):
            (folder / path.name).symlink_to(path)
    return folder


def model_with_template(model_dir: Path, folder: Path, chat_template: str) -> Path:
    """`folder` holding `model_dir`'s files (linked) with `chat_template` as the tokenizer's chat template."""
    linked_model(model_dir, folder, leave_out="tokenizer_config.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=chat_template)))
    return folder


@pytest.fixture(scope="session")
def emoji_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny model (weights linked) with a tokenizer whose vocabulary holds whole emoji as well."""
    folder = linked_model(tiny_model_dir, tmp_path_factory.mktemp("models") / tiny_model_dir.name)
    write_tokenizer(folder, _CORPUS + ["🙂 😀 🚀 🌍 emoji 🎉 party 🐍 python ✨"] * 3)
    return folder


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path):
    """The tiny model served as "tiny" behind test_server's API key: 4 sequences, a context of 256 (one per module)."""
    from test_server import API_KEY, LiveServer

    live = LiveServer(tiny_model_dir, dict(max_batch_size=4, max_seq_len=256), api_key=API_KEY,
                      served_model_name="tiny")
    yield live
    live.close()


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@contextmanager
def imported_benchmarks(*names: str):
    """The scripts `names` of benchmarks/ imported as modules, in order (they import one another by plain name,
    so the folder is on sys.path while the body runs)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield tuple(importlib.import_module(name) for name in names)
    finally:
        sys.path.remove(str(BENCHMARKS))
