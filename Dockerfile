# Image for docker-compose.yml (CPU). On a CUDA host install a CUDA build of torch instead.
FROM python:3.11-slim
WORKDIR /app
COPY . .
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir .
