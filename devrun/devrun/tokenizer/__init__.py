"""Tokenization: Hugging Face tokenizer files, chat templates and streaming detokenization."""

from .chat_template import ChatTemplateError
from .detokenizer import IncrementalDetokenizer
from .hf_tokenizer import Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]
