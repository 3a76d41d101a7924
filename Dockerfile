# tierckpt agent image: `docker compose up` builds it (see docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Sources only (.dockerignore keeps out the venv, tests and caches); a plain,
# non-editable install, so /src is not needed at run time.
COPY . .
RUN pip install . \
 && useradd --uid 1000 --create-home tierckpt \
 && mkdir -p /ssd/checkpoints /etc/tierckpt \
 && chown tierckpt:tierckpt /ssd/checkpoints

# Unprivileged; /ssd/checkpoints is created here so a fresh named volume
# mounted on it inherits the tierckpt owner.
USER tierckpt
WORKDIR /home/tierckpt
EXPOSE 8470
ENTRYPOINT ["tierckpt"]
CMD ["serve", "--config", "/etc/tierckpt/config.toml"]
