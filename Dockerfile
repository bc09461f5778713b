# One image for the API, the worker and the cron scheduler (compose.yaml picks the command).
# On a GPU host the torch wheel from PyPI brings its CUDA runtime; the host's NVIDIA driver
# comes in through the NVIDIA container toolkit.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

COPY pyproject.toml README.md ./
COPY api ./api
COPY results ./results
COPY worker ./worker
RUN pip install .

EXPOSE 8000
CMD ["fanout", "api", "--host", "0.0.0.0", "--port", "8000"]
