"""Our serving runtime (DESIGN.md, Runtime), in nano-vllm's shape:

- config.py         RuntimeConfig: backend, device, slots, CUDA graphs, PDL, tile table — chosen once
- tiles.py          TileTable: GEMV tiles as data (ocriaquant/recipes/tiles/*.json)
- engine.py         requests in, text out; continuous batching
- scheduler.py      which sequences run this step
- model_runner.py   ModelRunner: state buffers, batch buckets, CUDA graphs, the decode step
- models/qwen3_5.py the Qwen3.5 decoder assembled from a tensor store (load.py)
- layers/           linear formats, GDN, attention, MLP, norms — one file per concern
- kernels/          Triton kernels (leaves), reference.py beside them (plain torch)

Never imports llmcompressor."""
