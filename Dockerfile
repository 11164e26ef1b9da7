# sparring's image, in two stages:
#   build    turns pyproject.toml's pinned dependencies and the project itself into wheels and installs
#            them into a virtualenv (/opt/sparring);
#   runtime  a fresh slim image with only that virtualenv and the entrypoint: no pip cache, no sources,
#            no build tools; runs as an unprivileged user.
# Build: docker build -t sparring .      Run: see docker-compose.yml and docs/deploy.md.
# Air-gapped: put every wheel into deploy/wheelhouse/ on a connected machine, then
#   docker build --build-arg OFFLINE=1 --build-arg PYTHON_IMAGE=<a Python 3.11+ image of yours> .
# and pip installs with --no-index from those wheels only (docs/deploy.md, "Offline builds").
# No `# syntax=` line: the engine's built-in Dockerfile frontend builds it, without pulling a frontend
# image from a registry.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# 1: pip reads only deploy/wheelhouse/ (PIP_NO_INDEX, PIP_FIND_LINKS); 0: pip reads the package index.
ARG OFFLINE=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/sparring
# Dependencies first, from the pins in pyproject.toml (the client's and the `server` extra's): this layer
# is rebuilt only when they change.
COPY pyproject.toml README.md ./
COPY deploy/wheelhouse/ /wheelhouse/
RUN if [ "$OFFLINE" = 1 ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse; fi \
 && python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['server']))" \
        > /tmp/requirements.txt \
 && /opt/sparring/bin/pip wheel --wheel-dir /wheels -r /tmp/requirements.txt \
 && /opt/sparring/bin/pip install --no-index --find-links /wheels -r /tmp/requirements.txt
# Then the project (server, tool packs, migrations, trainer client) as a wheel of its own.
COPY app ./app
COPY tools ./tools
COPY migrations ./migrations
COPY sparring ./sparring
# (Its build backend, setuptools, comes from the wheelhouse too when OFFLINE=1.)
RUN if [ "$OFFLINE" = 1 ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse; fi \
 && /opt/sparring/bin/pip wheel --no-deps --wheel-dir /wheels/project . \
 && /opt/sparring/bin/pip install --no-index --no-deps /wheels/project/sparring-*.whl \
 && /opt/sparring/bin/sparring --help > /dev/null

FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/sparring/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SPARRING_HOME=/var/lib/sparring
# bubblewrap: the code pack's sandbox (it needs user namespaces: see docs/deploy.md). An offline build
# keeps what its base image has: without bwrap there, the code pack would refuse to start, so a build
# for the code pack (CODE_PACK=1, as docker-compose.code.yml sets) fails; any other warns and goes on.
ARG OFFLINE=0
ARG CODE_PACK=0
RUN if command -v bwrap >/dev/null; then :; \
    elif [ "$OFFLINE" = 1 ] && [ "$CODE_PACK" = 1 ]; then \
         echo "error: CODE_PACK=1 but the base image has no bubblewrap (bwrap), and an offline build cannot install it: use a base with the bubblewrap package" >&2; exit 1; \
    elif [ "$OFFLINE" = 1 ]; then echo "no bubblewrap in the base image: the code pack will not start" >&2; \
    else apt-get update && apt-get install -y --no-install-recommends bubblewrap \
         && rm -rf /var/lib/apt/lists/*; fi \
 && groupadd --system --gid 10001 sparring \
 && useradd --system --uid 10001 --gid sparring --home-dir /var/lib/sparring --create-home \
        --shell /usr/sbin/nologin sparring
COPY --from=build /opt/sparring /opt/sparring
# Executable in the repository (mode 0755 is checked by tests/deploy/test_container_files.py).
COPY deploy/entrypoint.sh /usr/local/bin/sparring-entrypoint
WORKDIR /var/lib/sparring
# A numeric user, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
EXPOSE 8000
# Liveness only (the process answers); readiness (database and Redis reachable) is /readyz.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SPARRING_PORT', '8000') + '/healthz', timeout=4)"]
# Waits for the database, runs `sparring db upgrade` (once across replicas: advisory lock), then
# `exec sparring serve --host ${SPARRING_HOST:-0.0.0.0} --workers ${SPARRING_WORKERS:-2}`. Other commands
# run as given.
ENTRYPOINT ["sparring-entrypoint"]
CMD ["serve"]
