# The routers docs/cluster.md ran in front of reckon replicas, from PyPI (prebuilt wheels):
# SGLang's sglang-router (round_robin, cache_aware) and vLLM's fork vllm-router (kv_aware).
#   docker build -f deploy/router.Dockerfile -t reckon-router deploy
FROM python:3.11-slim-bookworm
RUN pip install --no-cache-dir "sglang-router==0.3.2" "vllm-router==0.1.17" \
    && useradd --system --uid 10002 router
USER router
EXPOSE 8000
ENTRYPOINT ["python", "-m", "sglang_router.launch_router", "--host", "0.0.0.0", "--port", "8000"]
