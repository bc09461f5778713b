"""The OpenAI-compatible API: models, chat completions, completions, responses and embeddings (online,
through the queue at high priority), files and batches (a batch is a native job underneath).
Objects, names and errors are OpenAI's; extensions are documented in docs/openai.md."""
from fastapi import APIRouter

from . import batches, completions, embeddings, files, models, responses

router = APIRouter(prefix="/v1")
for module, tag in ((models, "OpenAI"), (completions, "OpenAI"), (responses, "OpenAI"), (embeddings, "OpenAI"),
                    (files, "OpenAI files and batches"), (batches, "OpenAI files and batches")):
    router.include_router(module.router, tags=[tag])
