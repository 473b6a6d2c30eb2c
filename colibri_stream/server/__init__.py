"""The OpenAI-compatible HTTP server (aiohttp): chat and text completions, streaming over SSE, models, metrics."""

from .app import create_app
from .serving import drain, run_server, serve

__all__ = ["create_app", "drain", "run_server", "serve"]
