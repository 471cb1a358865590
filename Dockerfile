# kvroute: the router (`kvroute serve`), the engine simulator (`kvroute engine`) and Locust, in one
# image used by compose.yaml. Build: docker build -t kvroute:local .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

COPY pyproject.toml README.md ./
COPY kvcore ./kvcore
COPY policies ./policies
COPY router ./router
COPY sim ./sim
COPY loadtest ./loadtest
COPY data ./data
# scale = redis (shared state of replicas), tokenizers = hf tokenizer backend, load = locust.
RUN pip install ".[scale,tokenizers,load]"

RUN useradd --create-home --uid 10001 kvroute && mkdir -p /mnt/kv-cache && chown kvroute /mnt/kv-cache
USER kvroute
EXPOSE 8000 5557 5567
ENTRYPOINT ["kvroute"]
CMD ["serve", "--help"]
