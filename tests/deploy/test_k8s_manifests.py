"""deploy/k8s against what it runs on and what it runs: core kinds validated with
kubernetes-validate, custom resources against the kept CRD schemas, the container args
parsed by jaxserve's own parser (with LWS's variables filled in), the API keys taken from a
Secret, the images' unprivileged user, the drain timings against --drain-timeout, and every
metric the dashboard, alerts and autoscaler query
present on a live server's /metrics."""

import copy
import re
import tomllib

import jsonschema
import kubernetes_validate
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.cli.main import build_parser
from jaxserve.presets import load_preset
from k8s_helpers import (KUBERNETES_VERSION, REPO, crd_kinds, crd_schema, dashboard, expand,
                         find, manifests, metric_names, promql_expressions, wait_until)
from tiny_models import SMALL_ENGINE

CRD_KINDS = crd_kinds()
DOCS = manifests()
LWS_ENV = {"LWS_LEADER_ADDRESS": "jaxserve-tpu-0.jaxserve-tpu.default"}  # as LWS sets it


def validate_core(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def validate_custom(doc: dict) -> None:
    jsonschema.Draft202012Validator(crd_schema(doc["apiVersion"], doc["kind"])).validate(doc)


def pod_templates(doc: dict) -> list[dict]:
    """The pod templates a workload holds (a LeaderWorkerSet has two)."""
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return [doc["spec"]["template"]] if "template" in doc.get("spec", {}) else []


@pytest.mark.parametrize("path, doc", DOCS, ids=[f"{p}:{d['kind']}" for p, d in DOCS])
def test_manifest_is_valid(path, doc):
    if doc["kind"] in CRD_KINDS:
        validate_custom(doc)
        for template in pod_templates(doc):  # the trimmed CRD leaves PodSpec open
            validate_core({"apiVersion": "v1", "kind": "PodTemplate",
                           "metadata": {"name": "template"}, "template": template})
    else:
        validate_core(doc)


def test_every_kind_has_a_schema():
    kinds = {d["kind"] for _, d in DOCS}
    assert {"Deployment", "Service", "LeaderWorkerSet", "ScaledObject", "ServiceMonitor",
            "PrometheusRule"} <= kinds
    assert {"LeaderWorkerSet", "ScaledObject", "ServiceMonitor", "PrometheusRule"} <= set(
        CRD_KINDS)


@pytest.mark.parametrize("kind, path, value", [
    ("Deployment", ("spec", "template", "spec", "containers", 0, "imagePullPolicyy"), "Always"),
    ("ScaledObject", ("spec", "triggers", 0, "metadata", "threshold"), 8),  # must be a string
    ("ServiceMonitor", ("spec", "endpoints", 0, "intervall"), "15s"),
    ("PrometheusRule", ("spec", "groups", 0, "rules", 0, "for"), "ten minutes"),
    ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "restartPolicy"), "Always"),
])
def test_validation_catches_a_mistake(kind, path, value):
    doc = copy.deepcopy(find(kind))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        (validate_custom if kind in CRD_KINDS else validate_core)(doc)


def container(template: dict) -> dict:
    (only,) = template["spec"]["containers"]
    return only


def parse(c: dict, env: dict[str, str] | None = None):
    """The container's command line as `jaxserve` parses it."""
    assert c["command"] == ["jaxserve"]
    env = {**{e["name"]: e["value"] for e in c.get("env", []) if "value" in e}, **(env or {})}
    return build_parser().parse_args(expand(c["args"], env))


def sleep_seconds(c: dict) -> int:
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return int(command[1])


def port(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def check_http_server(template: dict, args) -> None:
    """Serving container: bound for the cluster, probes where jaxserve answers them, and a
    grace period that lets the preStop sleep and the whole drain finish before SIGKILL."""
    c = container(template)
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert args.port == port(c, "http")
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "httpGet" not in c["livenessProbe"]  # /health is 503 for the whole warm-up
    grace = template["spec"]["terminationGracePeriodSeconds"]
    assert grace >= sleep_seconds(c) + args.drain_timeout + 10
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    assert any(args.model.startswith(m + "/") for m in mounts), (args.model, mounts)
    check_keys_from_a_secret(c, args)


def check_keys_from_a_secret(c: dict, args) -> None:
    """The keys come from a Secret through the environment (`jaxserve.server.auth`), never
    as flags (which the pod spec and `ps` show); the inference key is required, so a pod
    without its Secret does not start open."""
    assert args.api_key is None and args.admin_api_key is None
    sources = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    assert set(sources) == {"JAXSERVE_API_KEY", "JAXSERVE_ADMIN_API_KEY"}, sources
    assert not sources["JAXSERVE_API_KEY"].get("optional", False)
    assert sources["JAXSERVE_API_KEY"]["key"] != sources["JAXSERVE_ADMIN_API_KEY"]["key"]


def test_gpu_deployment_args_parse():
    template = find("Deployment", "jaxserve")["spec"]["template"]
    args = parse(container(template))
    check_http_server(template, args)
    preset = load_preset(args.config)  # a shipped preset, by name
    assert preset.platform == "gpu"
    assert preset.devices == container(template)["resources"]["limits"]["nvidia.com/gpu"]
    assert (args.coordinator_address, args.num_processes, args.process_id) == (None,) * 3


def test_lws_args_parse_into_a_multihost_group():
    lws = find("LeaderWorkerSet")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    size = lwt["size"]
    leader, worker = lwt["leaderTemplate"], lwt["workerTemplate"]
    assert container(leader)["args"] == container(worker)["args"]  # one SPMD program
    coordinator = f"{LWS_ENV['LWS_LEADER_ADDRESS']}:{port(container(leader), 'coordinator')}"
    for index in range(size):
        template = leader if index == 0 else worker
        args = parse(container(template), {**LWS_ENV, "LWS_GROUP_SIZE": str(size),
                                           "LWS_WORKER_INDEX": str(index)})
        assert args.coordinator_address == coordinator
        assert (args.num_processes, args.process_id) == (size, index)
    check_http_server(leader, parse(container(leader), {
        **LWS_ENV, "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": "0"}))
    chips_per_host = container(worker)["resources"]["limits"]["google.com/tpu"]
    topology = worker["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
    chips = 1
    for side in topology.split("x"):
        chips *= int(side)
    assert args.tensor_parallel_size == size * chips_per_host == chips
    assert load_preset(args.config).platform == "tpu"
    # workers follow the leader's steps until it stops them: they outlive its drain
    assert sleep_seconds(container(worker)) >= sleep_seconds(container(leader)) + \
        args.drain_timeout
    assert "readinessProbe" not in container(worker)  # followers serve no HTTP


def test_services_and_scrape_reach_the_servers():
    deployment, lws = find("Deployment"), find("LeaderWorkerSet")
    gpu, tpu = find("Service", "jaxserve"), find("Service", "jaxserve-tpu-api")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert gpu["spec"]["selector"].items() <= labels.items()
    assert tpu["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
                                       "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    assert tpu["metadata"]["name"] != lws["metadata"]["name"]  # LWS's headless Service
    monitor = find("ServiceMonitor")["spec"]
    for service in (gpu, tpu):
        assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert service["metadata"]["labels"][monitor["jobLabel"]] == "jaxserve"
        assert monitor["endpoints"][0]["port"] in [p["name"] for p in service["spec"]["ports"]]
    target = find("ScaledObject")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    for where, expr in promql_expressions().items():
        assert 'job="jaxserve"' in expr or 'service="jaxserve"' in expr, where


@pytest.fixture(scope="module")
def live_metrics(folder):
    """Sample names on /metrics of a real server after one completion (so histograms have
    samples): the app in-process, a tiny random model, a small engine."""
    from fastapi.testclient import TestClient

    from jaxserve.server.app import create_app
    from jaxserve.server.state import ServerOptions, ServerState

    engine = {**SMALL_ENGINE, "max_num_seqs": 2, "seq_buckets": (2,),  # two programs
              "max_num_batched_tokens": 16, "token_buckets": (16,)}
    state = ServerState(ServerOptions(model=str(folder), served_model_name=["tiny"],
                                      dtype="float32", engine_options=engine))
    with TestClient(create_app(state)) as client:
        wait_until(lambda: client.get("/health").status_code == 200, 300,
                   lambda: f"not ready: {state.not_ready_reason()}")
        done = client.post("/v1/completions", json={
            "model": "tiny", "prompt": "Once upon a time", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True})
        assert done.status_code == 200, done.text
        text = client.get("/metrics").text
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_queried_metric_is_served(live_metrics):
    exprs = promql_expressions()
    assert len(exprs) >= 15 and len(dashboard()["panels"]) >= 6
    missing = {where: sorted(metric_names(e) - live_metrics) for where, e in exprs.items()}
    assert not {w: m for w, m in missing.items() if m}, missing
    queried = set().union(*map(metric_names, exprs.values()))
    for needed in ("vllm:time_to_first_token_seconds_bucket",
                   "vllm:inter_token_latency_seconds_bucket", "vllm:generation_tokens_total",
                   "vllm:num_requests_waiting", "vllm:num_requests_running",
                   "vllm:kv_cache_usage_perc", "vllm:request_success_total"):
        assert needed in queried


def test_the_images_are_the_ones_the_dockerfiles_build_with_the_readme_extras():
    """deploy/docker builds `jaxserve:cuda` and `jaxserve:tpu` with the extras of the same
    name (pyproject), which the README's install section names; the GPU Deployment runs the
    first and the TPU LeaderWorkerSet the second."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    readme = (REPO / "README.md").read_text()
    built = {}
    for extra in ("cuda", "tpu"):
        dockerfile = REPO / "deploy" / "docker" / f"{extra}.Dockerfile"
        text = dockerfile.read_text()
        build = re.search(r"docker build -f (\S+) -t (\S+) \.", text)
        assert build and build[1] == f"deploy/docker/{extra}.Dockerfile"
        built[extra] = build[2]
        assert re.search(rf'^RUN pip install .*"/app\[{extra}\]"$', text, re.MULTILINE)
        assert any(dep.startswith("jax[") for dep in extras[extra])
        assert f'pip install ".[{extra}]"' in readme
        assert f"docker build -f deploy/docker/{extra}.Dockerfile -t {built[extra]} ." in readme
    images = {kind: {container(t)["image"] for t in pod_templates(find(kind))}
              for kind in ("Deployment", "LeaderWorkerSet")}
    assert images == {"Deployment": {built["cuda"]}, "LeaderWorkerSet": {built["tpu"]}}


def test_the_images_run_as_an_unprivileged_user():
    """Each Dockerfile switches to a numeric non-root user after installing (Kubernetes'
    runAsNonRoot can check a number only), and the GPU pod asks for that user."""
    users = set()
    for extra in ("cuda", "tpu"):
        text = (REPO / "deploy" / "docker" / f"{extra}.Dockerfile").read_text()
        user = re.search(r"^USER (\d+)(?::\d+)?$", text, re.MULTILINE)
        assert user and int(user[1]) != 0, extra
        assert text.index("RUN pip install") < user.start() < text.index("ENTRYPOINT")
        users.add(int(user[1]))
    context = find("Deployment", "jaxserve")["spec"]["template"]["spec"]["securityContext"]
    assert context["runAsNonRoot"] and {context["runAsUser"]} == users
