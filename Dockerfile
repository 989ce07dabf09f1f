# The image of the example workers in docker-compose.yml: this checkout installed with the Postgres, AWS and Flask
# extras. `docker compose up` builds it; run from the repository root so `examples` is importable.
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir -e '.[postgres,aws,flask]'
