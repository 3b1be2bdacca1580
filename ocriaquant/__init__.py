"""ocriaquant: mixed-precision quantization and serving for Qwen3.5 document-parsing VLMs."""

__version__ = "0.1.0"
