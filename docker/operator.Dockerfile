# The dmtd operator: kopf + pydantic + aiohttp + pyyaml, and our dmtd_operator package. No torch, no Ray.
#   docker build -f docker/operator.Dockerfile -t ghcr.io/dmtd/operator:0.1.0 .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

# The [operator] extra of pyproject.toml, installed by name so the base dependencies (torch) stay out.
RUN pip install "kopf>=1.38" "pydantic>=2.7,<3" "pyyaml>=6" "aiohttp>=3.9"

COPY operator/dmtd_operator /app/dmtd_operator
RUN python -c "import dmtd_operator.handlers, sys; assert 'torch' not in sys.modules and 'ray' not in sys.modules"

USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["kopf"]
CMD ["run", "--standalone", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz", "-m", "dmtd_operator.handlers"]
