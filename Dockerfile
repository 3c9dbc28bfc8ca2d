# The rankwatch worker image used by docker-compose.yml.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ingest ingest
COPY streams streams
COPY diagnosis diagnosis
COPY rankwatch rankwatch
COPY sql streams/sql
RUN pip install --no-cache-dir . && useradd --system rankwatch && mkdir -p /var/lib/rankwatch \
    && chown rankwatch /var/lib/rankwatch
USER rankwatch
ENTRYPOINT []
CMD ["rankwatch", "worker"]
