# migpilot: one image for the controller, the webhook and the node agent (`migpilot <command>`).
# Build: docker build -t migpilot:0.1.0 .
# The controller and the webhook run as the unprivileged user below; the agent's DaemonSet runs
# it privileged (MIG management needs the driver's privileged calls), as the Helm chart does.

FROM python:3.11-slim AS build
WORKDIR /src
# Pinned, hashed runtime dependencies first (a layer that changes only when the lock does):
# requirements-runtime.lock is requirements.lock without the dev tools (pytest, mypy, ruff,
# grpcio-tools...), same versions and hashes (scripts/lock writes both, a test checks them).
COPY requirements-runtime.lock ./
RUN python -m venv /opt/migpilot \
    && /opt/migpilot/bin/pip install --no-cache-dir --disable-pip-version-check \
       --require-hashes -r requirements-runtime.lock
COPY pyproject.toml README.md ./
COPY src ./src
# The project itself, as scripts/_env.sh installs it (not editable here): no dependencies, and
# built with the locked setuptools already installed above rather than an unpinned one fetched
# into an isolated build environment.
RUN /opt/migpilot/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps \
       --no-build-isolation .

FROM python:3.11-slim
COPY --from=build /opt/migpilot /opt/migpilot
ENV PATH=/opt/migpilot/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin migpilot
USER 10001
ENTRYPOINT ["migpilot"]
CMD ["--help"]
