"""Anthropic's Messages API and Message Batches, in its shapes, for the `anthropic` SDK
unchanged: a message is a native job (messages.py), a message batch a native job of many
items whose results are read back as Anthropic's (batches.py)."""
from fastapi import APIRouter

from . import batches, messages

router = APIRouter(prefix="/v1")
router.include_router(batches.router, tags=["Anthropic"])  # before /messages: its paths are longer
router.include_router(messages.router, tags=["Anthropic"])
