"""Tokenizer loading, encode/decode and chat templates, checked against transformers on locally built files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from colibri_stream.errors import CheckpointError, ColibriError
from colibri_stream.tokenizer import ChatTemplateError, Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model folders are local; never ask the hub

CORPUS = [
    "Hello world, this is a test of the tokenizer. The quick brown fox jumps over the lazy dog.",
    "Café, naïve, résumé — déjà vu. Ça va? Über straße.",
    "你好，世界！今天天气很好。我们去公园吧。",
    "Emoji: 🎉👍🏽 ok 😀 fine",
    "def f(x):\n    return x + 1\n\nprint(f(2))  # 3",
    "The user asked: what is the weather like in Paris today?",
] * 10

BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]

CHATML_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- continue %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.reasoning_content %}
        {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
    {%- endif %}
    {%- if message.content %}
        {{- message.content }}
    {%- endif %}
    {%- for tool_call in message.tool_calls or [] %}
        {{- '\\n<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
        {{- tool_call.function.arguments | tojson(indent=2) }}
        {{- '}\\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

MIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Plain (not "-") tags: the output depends on trim_blocks and lstrip_blocks exactly as transformers sets them.
TRIM_TEMPLATE = """{% for message in messages %}
    {% if message.role == 'user' %}
User: {{ message.content }}
    {% else %}
Bot: {{ message.content }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
Bot:{% endif %}"""

TOOL_USE_TEMPLATE = "TOOLS {{ tools | tojson }} {% for m in messages %}{{ m.content }}{% endfor %}"

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Bonjour, ça va? 你好 🎉"},
    {"role": "assistant", "content": "Très bien.", "reasoning_content": "The user greets me."},
    {"role": "user", "content": "What is the weather in Paris?"},
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo d'une ville",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

TOOL_CALL_MESSAGES = MESSAGES + [
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
]

ENCODE_TEXTS = [
    "", "Hello world", " leading space", "Café naïve — déjà vu", "你好，世界", "🎉👍🏽 mixed 😀 emoji",
    "<|im_start|>user\nhi<|im_end|>\n", "<s>[INST] question [/INST]</s>", "tabs\tand\nnewlines\n\n  ",
    "Zürich 東京 Москва عربى", "unknown chars: ЖЖ ♞ 𝄞",
]


def build_byte_level(folder: Path, config: dict, post_processor=None) -> Path:
    """A Qwen-style byte-level BPE tokenizer (ByteLevel pre-tokenizer and decoder) saved in `folder`."""
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=500, special_tokens=BYTE_LEVEL_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = post_processor or processors.ByteLevel(trim_offsets=False)
    return _save(folder, tok, config)


def build_sentencepiece(folder: Path, config: dict) -> Path:
    """A Llama/Mistral-style tokenizer: Metaspace ("▁") pre-tokenizer, byte fallback, a decoder that strips the
    first leading space, and a post-processor that prepends <s>."""
    tok = BackendTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60, show_progress=False))
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    first = max(vocab.values()) + 1
    vocab.update({f"<0x{b:02X}>": first + b for b in range(256)})  # byte-fallback pieces
    tok = BackendTokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return _save(folder, tok, config)


def _save(folder: Path, tok: BackendTokenizer, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}), encoding="utf-8")
    return folder


def chatml_folder(folder: Path, **config) -> Path:
    return build_byte_level(folder, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                     "chat_template": CHATML_TEMPLATE, **config})


def mixtral_folder(folder: Path, **config) -> Path:
    bos = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
           "single_word": False, "special": True}
    return build_sentencepiece(folder, {"bos_token": bos, "eos_token": "</s>", "unk_token": "<unk>",
                                        "add_bos_token": True, "add_eos_token": False,
                                        "chat_template": MIXTRAL_TEMPLATE, **config})


def hf_tokenizer(folder: Path):
    """transformers' tokenizer for `folder`. transformers 5 drops the config's add_bos_token/add_eos_token when
    there is a tokenizer.json (transformers 4 and the model-specific classes honour them); we honour them, so
    they are passed explicitly, which transformers 5 honours too."""
    import transformers

    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    flags = {key: config[key] for key in ("add_bos_token", "add_eos_token") if key in config}
    return transformers.AutoTokenizer.from_pretrained(str(folder), **flags)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "chatml": chatml_folder(root / "chatml"),
        "mixtral": mixtral_folder(root / "mixtral"),
        "eos": mixtral_folder(root / "eos", add_eos_token=True),
        "extra": chatml_folder(root / "extra", additional_special_tokens=["<|tool|>"], bos_token="<|startoftext|>",
                               added_tokens_decoder={"900": {"content": "<|plain|>", "special": False}}),
        "trim": build_byte_level(root / "trim", {"eos_token": "</s>", "chat_template": TRIM_TEMPLATE}),
    }


@pytest.mark.parametrize("name", ["chatml", "mixtral", "eos", "extra"])
def test_encode_decode_match_transformers(folders, name):
    ours, theirs = Tokenizer.from_folder(folders[name]), hf_tokenizer(folders[name])
    for text in ENCODE_TEXTS + ["<|tool|> and <|startoftext|> or <|plain|>"]:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == theirs.encode(text, add_special_tokens=add_special), (name, text, add_special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.vocab_size == len(theirs)
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_ids == (theirs.eos_token_id,)


def test_special_token_attributes(folders):
    mixtral = Tokenizer.from_folder(folders["mixtral"])
    assert mixtral.encode("hi")[0] == mixtral.bos_token_id == mixtral.token_to_id("<s>")
    assert Tokenizer.from_folder(folders["eos"]).encode("hi")[-1] == mixtral.token_to_id("</s>")
    chatml = Tokenizer.from_folder(folders["chatml"])
    assert chatml.bos_token_id is None and chatml.pad_token_id == chatml.token_to_id("<|endoftext|>")
    assert chatml.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_generation_config_adds_eos_ids(folders, tmp_path):
    folder = chatml_folder(tmp_path / "gen")
    chatml = Tokenizer.from_folder(folder)
    im_end, eot = chatml.token_to_id("<|im_end|>"), chatml.token_to_id("<|endoftext|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))
    assert Tokenizer.from_folder(folder).eos_token_ids == (im_end, eot)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eot}))
    assert Tokenizer.from_folder(folder).eos_token_ids == (im_end, eot)


@pytest.mark.parametrize("messages, tools, extra", [
    (MESSAGES, None, {}),
    (MESSAGES[1:], None, {}),
    (MESSAGES, TOOLS, {}),
    (TOOL_CALL_MESSAGES, TOOLS, {}),
    (MESSAGES, None, {"enable_thinking": False}),
])
def test_chatml_template_matches_transformers(folders, messages, tools, extra):
    ours, theirs = Tokenizer.from_folder(folders["chatml"]), hf_tokenizer(folders["chatml"])
    for add_generation_prompt in (True, False):
        expected = theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                              tokenize=False, **extra)
        got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra)
        assert got == expected
    assert '"Météo d\'une ville"' in ours.apply_chat_template(MESSAGES, tools=TOOLS)  # tojson keeps non-ASCII


@pytest.mark.parametrize("name", ["mixtral", "trim"])
def test_other_templates_match_transformers(folders, name):
    ours, theirs = Tokenizer.from_folder(folders[name]), hf_tokenizer(folders[name])
    messages = [m for m in MESSAGES if m["role"] != "system"]
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages) == expected
    if name == "mixtral":
        assert expected.startswith("<s>[INST] Bonjour") and "Très bien.</s>" in expected


def test_raise_exception_becomes_chat_template_error(folders):
    ours, theirs = Tokenizer.from_folder(folders["mixtral"]), hf_tokenizer(folders["mixtral"])
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="must alternate"):
        theirs.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="must alternate"):
        ours.apply_chat_template(bad)
    with pytest.raises(ChatTemplateError, match="Only user and assistant"):
        ours.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


@pytest.mark.parametrize("messages", [[], "hello", [{"content": "no role"}], ["not a dict"]])
def test_malformed_messages(folders, messages):
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_folder(folders["chatml"]).apply_chat_template(messages)


def test_template_errors_are_clear(tmp_path):
    folder = build_byte_level(tmp_path, {"eos_token": "</s>"})
    plain = Tokenizer.from_folder(folder)
    assert not plain.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        plain.apply_chat_template(MESSAGES)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        Tokenizer.from_folder(folder).apply_chat_template(MESSAGES)
    (folder / "chat_template.jinja").write_text("{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError, match="unsafe"):  # the immutable sandbox refuses to mutate
        Tokenizer.from_folder(folder).apply_chat_template(MESSAGES)


def test_template_files_and_named_templates(tmp_path):
    folder = build_byte_level(tmp_path, {"eos_token": "</s>", "chat_template": [
        {"name": "default", "template": MIXTRAL_TEMPLATE}, {"name": "tool_use", "template": TOOL_USE_TEMPLATE}]})
    ours, theirs = Tokenizer.from_folder(folder), hf_tokenizer(folder)
    chat = [{"role": "user", "content": "hi"}]
    for tools in (None, TOOLS):
        assert ours.apply_chat_template(chat, tools=tools) == theirs.apply_chat_template(
            chat, tools=tools, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(chat, tools=TOOLS).startswith("TOOLS [")

    (folder / "chat_template.jinja").write_text("JINJA {{ messages[0].content }}{{ eos_token }}")
    ours, theirs = Tokenizer.from_folder(folder), hf_tokenizer(folder)
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=False) == "JINJA hi</s>"


def test_strftime_now_and_generation_tag(tmp_path):
    template = ("{{ strftime_now('%Y') }}{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
                "{% endfor %}")
    folder = build_byte_level(tmp_path, {"eos_token": "</s>", "chat_template": template})
    chat = [{"role": "user", "content": "hi"}]
    got = Tokenizer.from_folder(folder).apply_chat_template(chat)
    assert got == hf_tokenizer(folder).apply_chat_template(chat, tokenize=False)
    assert got[:4].isdigit() and got.endswith("hi")


def test_unreadable_template_and_config_files_are_named(tmp_path):
    """A chat template that is not UTF-8, and a tokenizer_config.json nested too deep for the JSON reader: a
    CheckpointError naming the file, not a traceback."""
    folder = build_byte_level(tmp_path, {"eos_token": "</s>"})
    (folder / "chat_template.jinja").write_bytes(b"{{ \xff }}")
    with pytest.raises(CheckpointError, match="chat_template.jinja is not a readable UTF-8 chat template"):
        Tokenizer.from_folder(folder)
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(CheckpointError, match="tokenizer_config.json is not readable JSON"):
        Tokenizer.from_folder(folder)


def test_a_prompt_with_a_token_past_the_models_vocabulary_is_refused(tmp_path):
    """A tokenizer.json whose ids run past config.json's vocab_size (a folder whose files do not match): a prompt
    that encodes to such an id is an InvalidParameterError naming the mismatch (it indexed past the embedding)."""
    import shutil

    from colibri_stream.checkpoint import default_model_path, read_config
    from colibri_stream.errors import InvalidParameterError
    from colibri_stream.request import SamplingParams
    from colibri_stream.request_checks import RequestChecks

    folder = Path(shutil.copytree(default_model_path(), tmp_path / "model"))
    config = read_config(folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"]["vocab"]["hi"] = config.vocab_size + 808
    (folder / "tokenizer.json").write_text(json.dumps(data))
    checks = RequestChecks(Tokenizer.from_folder(folder), config, 64, frozenset())
    checks.validate(checks.encode_prompt("hello"), SamplingParams(max_tokens=4))  # ids within the vocabulary
    with pytest.raises(InvalidParameterError, match="past the model's vocabulary .* does not match its config.json"):
        checks.validate(checks.encode_prompt("hi"), SamplingParams(max_tokens=4))


def test_missing_or_broken_tokenizer_json(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        Tokenizer.from_folder(tmp_path)
    assert issubclass(ChatTemplateError, ColibriError)


def test_token_bytes_are_the_raw_bytes_of_each_token(folders):
    """Byte-level tokens that split a character give their own bytes (not U+FFFD); together they are the text."""
    tokenizer = Tokenizer.from_folder(folders["chatml"])
    text = "naïve café 数据 🙂🚀 <|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    assert any(p and not _is_utf8(p) for p in pieces)  # some token really holds part of a character
    with pytest.raises(ValueError):
        tokenizer.token_bytes(10**9)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
