# One image for the API, the worker and the cron scheduler (compose.yaml picks the command).
# GPU: pip takes torch from PyPI, whose Linux x86_64 wheel is the CUDA 13 build and brings its
# own CUDA runtime; the host's NVIDIA driver comes in through the NVIDIA container toolkit.
# CUDA 13.0 needs NVIDIA Linux driver >= 580 on the host (`nvidia-smi` shows it); with an
# older driver torch sees no GPU (torch.cuda.is_available() is False) and the worker fails
# at start-up with --device cuda.
FROM python:3.11-slim

# A C compiler and libc headers: the first time a Triton kernel runs (the worker's attention
# on CUDA), Triton compiles a small C launcher with the system compiler (Python.h comes with
# this image). Without gcc the GPU worker fails on its first forward.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/hf

# The processes run as this user (fixed uid, so volume ownership is predictable). /models and
# /blobs are where compose mounts the model volume and the blob store's: a new named volume
# takes the ownership of the image's folder, so the Hugging Face cache and the files there
# are writable. Triton's kernel cache goes to the user's home (~/.triton).
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/fanout \
        --shell /usr/sbin/nologin fanout \
 && mkdir -p /models/hf /blobs \
 && chown -R fanout:fanout /models /blobs

WORKDIR /app
COPY pyproject.toml README.md ./
COPY api ./api
COPY cli ./cli
COPY jobs ./jobs
COPY results ./results
COPY worker ./worker
# The parquet extra: Parquet datasets in, GET /v1/jobs/{id}/output?format=parquet out.
RUN pip install ".[parquet]"

USER fanout
EXPOSE 8000
CMD ["fanout", "api", "--host", "0.0.0.0", "--port", "8000"]
