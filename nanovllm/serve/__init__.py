"""The OpenAI-compatible server (`python -m nanovllm.serve MODEL`): cli.py (flags, stopping),
app.py (routes and the gate in front of them), protocol.py (request bodies), responses.py
(response bodies), engine_thread.py (the thread that owns the engine). Needs `pip install
nanovllm[serve]` (FastAPI and uvicorn); the engine itself never imports this package."""
