# sweepd's container image. `docker build -t sweepd .` then `docker run sweepd` runs the example
# config on an embedded SQLite file; mount your own config over /etc/sweepd/sweepd.yaml.
#
# BASE is any Debian-like image with python3 >= 3.11 and its venv module (python:3.11-slim, or
# Debian's python3 and python3-venv); both stages use it, so the virtualenv made in the first
# runs unchanged in the second.
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY sweepd/ sweepd/
# The database drivers to install, as the package's extras ("" for SQLite only).
ARG EXTRAS=postgres,mysql
# The wheel is built and installed by a throwaway pip (/opt/build); /opt/venv gets no pip of
# its own, and it is all the final stage takes from this one.
RUN python3 -m venv /opt/build \
 && /opt/build/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && python3 -m venv --without-pip /opt/venv \
 && wheel="$(echo /wheels/sweepd-*.whl)" \
 && /opt/build/bin/pip --python /opt/venv/bin/python install "${wheel}${EXTRAS:+[${EXTRAS}]}"

FROM ${BASE}
LABEL org.opencontainers.image.title="sweepd" \
      org.opencontainers.image.description="Periodic maintenance jobs, each tick run exactly once across replicas" \
      org.opencontainers.image.licenses="MIT"
# A fixed numeric uid and gid, so a volume's ownership and a Kubernetes runAsUser can name them.
RUN groupadd --gid 10001 sweepd \
 && useradd --uid 10001 --gid 10001 --no-log-init --no-create-home \
      --home-dir /var/lib/sweepd --shell /usr/sbin/nologin sweepd \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/sweepd
COPY --from=build /opt/venv /opt/venv
COPY config.example.yaml /etc/sweepd/sweepd.yaml
# The health server must listen beyond the container's loopback for a published port or a
# probe to reach it; SWEEPD_HEALTH_LISTEN overrides the config's health.listen.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SWEEPD_CONFIG=/etc/sweepd/sweepd.yaml \
    SWEEPD_HEALTH_LISTEN=0.0.0.0:9464
# The state folder: the example's sqlite:///sweepd.db is relative to the working directory.
WORKDIR /var/lib/sweepd
USER 10001:10001
EXPOSE 9464
STOPSIGNAL SIGTERM
# No curl in a slim image: the venv's python asks /healthz on the port SWEEPD_HEALTH_LISTEN names.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["/opt/venv/bin/python", "-c", "import os, urllib.request; port = os.environ.get('SWEEPD_HEALTH_LISTEN', '').rpartition(':')[2] or '9464'; urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=4)"]
# Exec form: sweepd is PID 1 and receives SIGTERM itself, which starts its drain.
ENTRYPOINT ["/opt/venv/bin/sweepd"]
CMD ["run"]
