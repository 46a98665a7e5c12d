# hotswap on the official vLLM OpenAI image: the router and the engines it starts share
# this image, so the worker extension (engines.vllm_worker) is importable inside every engine.
FROM vllm/vllm-openai:v0.33.0

WORKDIR /opt/hotswap
COPY pyproject.toml README.md ./
COPY config ./config
COPY engines ./engines
COPY router ./router
# --no-deps: vLLM's image already carries aiohttp, uvloop, prometheus-client, pyyaml and pydantic 2.
RUN pip install --no-cache-dir --no-deps . \
 && python -c "import router.cli, engines.engine, config" \
 && useradd --system --create-home --home-dir /var/lib/hotswap hotswap

USER hotswap
ENV XDG_STATE_HOME=/var/lib/hotswap
EXPOSE 8080
# The roster is mounted: docker run -v ./roster.yaml:/etc/hotswap/roster.yaml:ro ...
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2).status == 200 else 1)"
ENTRYPOINT ["hotswap"]
CMD ["serve", "--config", "/etc/hotswap/roster.yaml", "--host", "0.0.0.0"]
