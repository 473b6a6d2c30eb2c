# Colibri on an NVIDIA GPU: CUDA 12 runtime (with NVRTC, which CuPy needs to compile kernels/*.cu at run time).
# Build: docker build -t colibri .    Run: docker run --gpus all -p 8000:8000 -v /models:/models colibri --model /models/m
FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/colibri
ENV PATH=/opt/colibri/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md ./
COPY colibri_stream ./colibri_stream
COPY export ./export
COPY tokenizer ./tokenizer
COPY kernels ./kernels
RUN pip install ".[gpu]" && rm -rf /src

EXPOSE 8000
ENTRYPOINT ["colibri", "serve", "--host", "0.0.0.0", "--port", "8000"]
