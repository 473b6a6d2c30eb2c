"""Tokenization: Hugging Face tokenizer files, chat templates and streaming detokenization."""

from .chat_template import RESERVED_VARIABLES, ChatTemplateError
from .detokenizer import IncrementalDetokenizer
from .hf_tokenizer import Tokenizer

__all__ = ["RESERVED_VARIABLES", "ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]
