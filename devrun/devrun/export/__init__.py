"""Export Hugging Face mixture-of-experts checkpoints (safetensors) into the native model folder format."""

from .convert import export_model

__all__ = ["export_model"]
