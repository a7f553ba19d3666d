# jaxserve for Cloud TPU VMs and GKE TPU node pools: jaxserve with the `tpu` extra (JAX with
# libtpu). The Kubernetes recipe deploy/k8s/tpu/ runs this image.
#   docker build -f deploy/docker/tpu.Dockerfile -t jaxserve:tpu .
#   docker run --privileged --net=host -v ~/.cache/huggingface:/root/.cache/huggingface \
#       jaxserve:tpu serve --model ORG/NAME --config v6e-8 --host 0.0.0.0
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir "/app[tpu]"
EXPOSE 8000
ENTRYPOINT ["jaxserve"]
CMD ["serve", "--host", "0.0.0.0"]
