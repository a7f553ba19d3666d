# jaxserve for NVIDIA GPUs: jaxserve with the `cuda` extra (JAX with its CUDA 13 and cuDNN
# wheels, so the base image needs only the host's driver, through the NVIDIA container
# toolkit). The Kubernetes recipe deploy/k8s/gpu/ runs this image.
#   docker build -f deploy/docker/cuda.Dockerfile -t jaxserve:cuda .
#   docker run --gpus all -p 8000:8000 -e JAXSERVE_API_KEY \
#       -v ~/.cache/huggingface:/home/jaxserve/.cache/huggingface \
#       jaxserve:cuda serve --model ORG/NAME --config h100-1 --host 0.0.0.0
# It runs as the unprivileged user jaxserve (uid 10001), and listens on every interface
# inside the container: give it a key (JAXSERVE_API_KEY, and JAXSERVE_ADMIN_API_KEY for
# /admin/reload and the LoRA routes) through the environment, not as flags, which `ps`
# and the pod spec show.
FROM python:3.11-slim
RUN useradd --create-home --uid 10001 --user-group jaxserve
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir "/app[cuda]"
USER 10001:10001
ENV HOME=/home/jaxserve
EXPOSE 8000
ENTRYPOINT ["jaxserve"]
CMD ["serve", "--host", "0.0.0.0"]
