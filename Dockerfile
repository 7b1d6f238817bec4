# inferbus: one image for every service (gateway, router, worker, sim-engine, ...).
# The service is chosen by the first argument, e.g. `docker run inferbus gateway`.
#
# Build:  docker build -t inferbus:dev .
# The real SGLang engine is NOT in this image; it runs as its own container
# (lmsysorg/sglang) beside the worker. This image stays CPU-only and small.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- build stage: turn the source tree into a wheel (plus its dependencies) ----
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Copy only what the package build needs (see .dockerignore), so edits to tests or
# docs do not bust the layer cache.
COPY . .
# Extras of the package in the image: `k8s` for the autoscaler's Kubernetes actuator. Add `parquet`
# for INFERBUS_EXPORT_FORMAT=parquet (--build-arg EXTRAS=k8s,parquet); plots are for the CLI's
# capacity tools and stay out.
ARG EXTRAS=k8s
RUN pip wheel --wheel-dir /wheels ".[${EXTRAS}]"

# ---- runtime stage: no compilers, no source tree ----
FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Fixed uid/gid so k8s securityContext (runAsUser 10001) and volume ownership line up.
RUN groupadd --system --gid 10001 inferbus \
 && useradd --system --uid 10001 --gid inferbus --home-dir /home/inferbus --create-home inferbus

COPY --from=build /wheels /wheels
RUN pip install --no-index --find-links /wheels /wheels/*.whl && rm -rf /wheels

# A small model directory (a tokenizer trained on the standard library's sources, a Llama-3-style
# chat template) for the simulated engines and the services that render prompts. With a real
# engine, mount the directory it serves (at least tokenizer.json and tokenizer_config.json) and
# point INFERBUS_MODEL_DIR at it.
RUN INFERBUS_CACHE_DIR=/tmp/inferbus-build python -m inferbus.tokens.modeldir /opt/inferbus/model --format llama3 \
 && rm -rf /tmp/inferbus-build
ENV INFERBUS_MODEL_DIR=/opt/inferbus/model

USER 10001:10001
WORKDIR /home/inferbus

# Documentation only: gateway HTTP, router/worker metrics, sim-engine HTTP.
EXPOSE 8080 9101 9102 30000

# Services drain on SIGTERM (the worker hands back in-flight work), so keep the
# default signal and let the orchestrator's grace period do the rest.
STOPSIGNAL SIGTERM
ENTRYPOINT ["inferbus"]
CMD ["--help"]
