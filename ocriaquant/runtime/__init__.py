"""Our serving runtime: engine, scheduler, model runner, layers and Triton kernels (DESIGN.md).
Never imports llmcompressor."""
