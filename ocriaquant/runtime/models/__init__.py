"""Model definitions the runner serves: qwen3_5 (Qwen3.5 VLMs)."""
