# sdfast's HTTP image-generation service on an NVIDIA GPU.
#
#   docker build -t sdfast .
#   docker run --gpus all -p 8000:8000 -v /path/to/stable-diffusion-v1-5:/models/model:ro sdfast
#
# The first start compiles sdfast's Triton kernels (about 80 for SD1.5, a minute on an H200; measured
# 2026-11-29). They are cached under /home/sdfast/.cache (with the Hugging Face cache): mount a volume there,
# e.g. -v sdfast-cache:/home/sdfast/.cache, and later starts skip the compilation.
#
# The runtime base image has no nvcc, so the sm_90 cluster GroupNorm (kernels/group_norm/cluster.cu) is not
# built here and its Triton kernels run (logged once); a -devel base image (BASE_IMAGE) builds it on first use.
#
# Settings (environment): SDFAST_MODEL (a folder or .safetensors file inside the container, a hub id,
# or random:sd15), SDFAST_API_KEY (optional; then every endpoint but /health needs it),
# SDFAST_PORT, SDFAST_MAX_BATCH, SDFAST_QUEUE.
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

# Triton builds a small C launcher for each kernel at run time; the runtime image has no C compiler.
# (Unpinned: the distribution drops old package versions, so a pin breaks the build; the base tag is pinned.)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/sdfast
COPY pyproject.toml README.md ./
COPY sdfast ./sdfast
COPY kernels ./kernels
COPY server ./server
# torch and triton come with the base image: pip finds them satisfied and keeps them.
# (DL3013 asks for version pins: this installs the project itself, whose dependencies pyproject.toml bounds.)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[server]" \
    && python -c "import sdfast, server.app"

RUN groupadd --gid 10001 sdfast \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin sdfast
USER 10001:10001
WORKDIR /home/sdfast
ENV HF_HOME=/home/sdfast/.cache/huggingface \
    TRITON_CACHE_DIR=/home/sdfast/.cache/triton \
    SDFAST_MODEL=/models/model \
    SDFAST_PORT=8000 \
    SDFAST_MAX_BATCH=4 \
    SDFAST_QUEUE=64

EXPOSE 8000
# Loading a model and the first CUDA-graph captures take a while: give it 5 minutes before counting failures.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('SDFAST_PORT', '8000'), timeout=4)"]
CMD ["sh", "-c", "exec sdfast serve --host 0.0.0.0 --port \"$SDFAST_PORT\" --model \"$SDFAST_MODEL\" --max-batch \"$SDFAST_MAX_BATCH\" --queue \"$SDFAST_QUEUE\""]
