# The dmtd operator: kopf + pydantic + aiohttp + pyyaml + redis, the contract package dmtd_contract (registry
# client, metric names, variant schema) and our dmtd_operator package. No torch, no Ray, no dmtd.
#   make images    (podman, on the local Debian base: BASE_IMAGE=localhost/dmtd/debian-base:bookworm)
#   docker build -f docker/operator.Dockerfile -t ghcr.io/dmtd/operator:0.1.0 .    (public python slim base)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app

# A bare Debian base has no python3: take Debian's (3.11 on bookworm). The slim image has its own.
RUN if ! command -v python3 >/dev/null 2>&1; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv /opt/venv

# The [operator] extra of pyproject.toml (read from it, so the two never drift), without the base
# dependencies (torch). /host-ca.crt exists only where the build mounts the machine's CA bundle.
COPY pyproject.toml /src/pyproject.toml
COPY contract /src/contract
RUN if [ -f /host-ca.crt ]; then export PIP_CERT=/host-ca.crt; fi \
 && python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['optional-dependencies']['operator']))" > /src/operator-requirements.txt \
 && pip install --no-cache-dir -r /src/operator-requirements.txt \
 && pip install --no-cache-dir --no-deps /src/contract \
 && rm -rf /src

COPY operator/dmtd_operator /app/dmtd_operator
RUN python3 -c "import dmtd_operator.handlers, dmtd_operator.registry, sys; bad = {'torch', 'ray', 'dmtd'} & set(sys.modules); assert not bad, bad"

USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["kopf"]
CMD ["run", "--standalone", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz", "-m", "dmtd_operator.handlers"]
