# jaxserve for NVIDIA GPUs: jaxserve with the `cuda` extra (JAX with its CUDA 13 and cuDNN
# wheels, so the base image needs only the host's driver, through the NVIDIA container
# toolkit). The Kubernetes recipe deploy/k8s/gpu/ runs this image.
#   docker build -f deploy/docker/cuda.Dockerfile -t jaxserve:cuda .
#   docker run --gpus all -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface \
#       jaxserve:cuda serve --model ORG/NAME --config h100-1 --host 0.0.0.0
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir "/app[cuda]"
EXPOSE 8000
ENTRYPOINT ["jaxserve"]
CMD ["serve", "--host", "0.0.0.0"]
