"""Fanout's HTTP API: FastAPI app (api.app), job routes (api.submit), schemas, queueing."""
