# jaxserve for Cloud TPU VMs and GKE TPU node pools: jaxserve with the `tpu` extra (JAX with
# libtpu). The Kubernetes recipe deploy/k8s/tpu/ runs this image.
#   docker build -f deploy/docker/tpu.Dockerfile -t jaxserve:tpu .
#   docker run --privileged --net=host -e JAXSERVE_API_KEY \
#       -v ~/.cache/huggingface:/home/jaxserve/.cache/huggingface \
#       jaxserve:tpu serve --model ORG/NAME --config v6e-8 --host 0.0.0.0
# It runs as the unprivileged user jaxserve (uid 10001), and listens on every interface
# inside the container: give it a key (JAXSERVE_API_KEY, and JAXSERVE_ADMIN_API_KEY for
# /admin/reload and the LoRA routes) through the environment, not as flags, which `ps`
# and the pod spec show.
FROM python:3.11-slim
RUN useradd --create-home --uid 10001 --user-group jaxserve
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir "/app[tpu]"
USER 10001:10001
ENV HOME=/home/jaxserve
EXPOSE 8000
ENTRYPOINT ["jaxserve"]
CMD ["serve", "--host", "0.0.0.0"]
