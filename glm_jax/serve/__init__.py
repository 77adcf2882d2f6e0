"""glm-jax-serve: the OpenAI-style HTTP API over one Engine (app.py: starlette app, SSE, /metrics, uvicorn)."""
