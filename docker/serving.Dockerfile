# The serving image: Ray Serve + the dmtd package (engine, serve app `dmtd.serve.app:build_app`, registry).
# KubeRay starts `ray start` in it (head and workers); the operator's RayService points Serve at our app.
#   docker build -f docker/serving.Dockerfile -t ghcr.io/dmtd/serving:0.1.0 .
# The PyPI torch wheel for Linux x86-64 brings its CUDA runtime libraries; the node provides the driver.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG RAY_VERSION=2.60.0
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_USAGE_STATS_ENABLED=0

# KubeRay's default probes call wget; Ray's scripts want bash.
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget bash ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY platform platform
COPY operator operator
COPY proto proto
RUN pip install . "ray[serve]==${RAY_VERSION}" \
 && python -c "import dmtd, ray; print('dmtd', dmtd.__file__, 'ray', ray.__version__)"

RUN useradd --create-home --uid 1000 ray
USER 1000
WORKDIR /home/ray
# Serve HTTP, Serve gRPC (the gateway), dmtd_* metrics.
EXPOSE 8000 9000 9464
