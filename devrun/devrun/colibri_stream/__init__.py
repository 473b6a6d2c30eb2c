"""Colibri: serve mixture-of-experts language models through an OpenAI-compatible streaming API."""

__version__ = "0.1.0"
