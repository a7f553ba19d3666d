"""Runtime LoRA updating, engine-free: the operator's opt-in (`--allow-runtime-lora-updating`
or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) and where runtime loads may come from
(`jaxserve.lora.runtime`: folders under the allowed roots after symlinks and `..` are
resolved, one answer whether a refused path exists or not); the registry's cap
(`max_cpu_loras`) and one load per name at a time (`jaxserve.lora.registry`)."""

import threading

import pytest

from jaxserve.cli.main import build_parser
from jaxserve.cli.serve_command import runtime_lora_updating
from jaxserve.config.engine import EngineConfig
from jaxserve.lora import registry as registry_module
from jaxserve.lora.adapter import LoRAAdapter
from jaxserve.lora.registry import AdapterRegistry, LoRACapacityError, LoRAConflictError
from jaxserve.lora.runtime import ENV_VAR, RuntimeLoRAUpdating

pytestmark = pytest.mark.quick


@pytest.fixture
def tree(tmp_path):
    """roots/ (allowed) with a folder and a symlink out; outside/ with a folder."""
    (tmp_path / "roots" / "ok").mkdir(parents=True)
    (tmp_path / "outside" / "secret").mkdir(parents=True)
    (tmp_path / "roots" / "link").symlink_to(tmp_path / "outside" / "secret")
    return tmp_path


def test_runtime_loads_come_from_under_the_allowed_roots(tree):
    policy = RuntimeLoRAUpdating(allowed_roots=(str(tree / "roots"),))
    assert policy.resolve(str(tree / "roots" / "ok")) == str(tree / "roots" / "ok")
    assert policy.resolve(str(tree / "roots" / "ok" / ".." / "ok")) == str(tree / "roots" / "ok")
    refusals = set()
    for escape in (tree / "outside" / "secret",  # exists
                   tree / "outside" / "nothing",  # does not
                   tree / "roots" / ".." / "outside" / "secret",  # `..` out
                   tree / "roots" / "link",  # a symlink out
                   tree / "roots" / "link" / "deeper"):
        with pytest.raises(ValueError) as refused:
            policy.resolve(str(escape))
        refusals.add(str(refused.value))
    assert refusals == {"lora_path must be a folder under the allowed roots "
                        "(--lora-allowed-roots)"}  # the same whether it exists or not
    with pytest.raises(ValueError, match="folder under the allowed roots"):
        policy.resolve("org/name")  # Hub ids only when allowed


def test_hub_ids_only_when_allowed(tree, monkeypatch):
    from jaxserve.lora import runtime

    fetched = []
    monkeypatch.setattr(runtime, "hub_adapter_folder",
                        lambda name: fetched.append(name) or tree / "snapshot")
    (tree / "org" / "name").mkdir(parents=True)  # a local folder that looks like a Hub id
    monkeypatch.chdir(tree)
    policy = RuntimeLoRAUpdating(allow_hub=True)
    assert policy.resolve("org/name@main") == str(tree / "snapshot")
    assert policy.resolve("org/name") == str(tree / "snapshot")  # the Hub's, never ./org/name
    assert fetched == ["org/name@main", "org/name"]
    with pytest.raises(ValueError, match="must be a Hugging Face Hub id"):
        policy.resolve(str(tree / "roots" / "ok"))


def test_the_opt_in_flag_and_environment_variable(tree, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    parse = build_parser().parse_args
    roots = ["--lora-allowed-roots", str(tree / "roots")]
    assert runtime_lora_updating(parse(["serve"])) is None  # off by default
    with pytest.raises(ValueError, match="add --allow-runtime-lora-updating"):
        runtime_lora_updating(parse(["serve", *roots]))
    on = runtime_lora_updating(parse(["serve", "--allow-runtime-lora-updating", *roots]))
    assert on == RuntimeLoRAUpdating((str(tree / "roots"),), allow_hub=False)
    with pytest.raises(ValueError, match="--lora-allowed-roots DIR .* and/or --lora-allow-hub"):
        runtime_lora_updating(parse(["serve", "--allow-runtime-lora-updating"]))
    for value, allowed in (("1", True), ("true", True), ("True", True), ("0", False),
                           ("no", False)):
        monkeypatch.setenv(ENV_VAR, value)
        got = runtime_lora_updating(parse(["serve", "--lora-allow-hub"])) if allowed else None
        assert got == (RuntimeLoRAUpdating(allow_hub=True) if allowed else None)
        if not allowed:
            with pytest.raises(ValueError, match="add --allow-runtime-lora-updating"):
                runtime_lora_updating(parse(["serve", "--lora-allow-hub"]))


def test_max_cpu_loras_is_at_least_max_loras():
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        EngineConfig(max_loras=2, max_cpu_loras=1)
    assert EngineConfig(max_loras=2, max_cpu_loras=5).max_cpu_loras == 5


@pytest.fixture
def registry(monkeypatch):
    """A registry of at most 2 adapters whose loads return stand-ins, optionally held up
    until `release` is set."""
    started, release = threading.Event(), threading.Event()
    release.set()

    def load(path, *_):
        started.set()
        assert release.wait(30)
        return LoRAAdapter(path, 1, {})

    monkeypatch.setattr(registry_module, "load_adapter", load)
    reg = AdapterRegistry(cfg=None, max_lora_rank=8, tensor_parallel_size=1, max_cpu_loras=2)
    reg.started, reg.release = started, release
    return reg


def test_adapters_beyond_max_cpu_loras_are_refused(registry):
    first = registry.add_folder("a", "/a")
    registry.add_folder("b", "/b")
    with pytest.raises(LoRACapacityError, match="2 LoRA adapters .* max_cpu_loras=2"):
        registry.add_folder("c", "/c")
    assert registry.add_folder("b", "/b2", replace=True).weights.path == "/b2"  # no new one
    assert registry.remove(first)
    assert registry.add_folder("c", "/c").name == "c"


def test_two_loads_of_one_name_at_once_one_succeeds(registry):
    registry.release.clear()
    results = {}
    first = threading.Thread(target=lambda: results.update(
        first=registry.add_folder("x", "/one")))
    first.start()
    assert registry.started.wait(30)
    threading.Timer(1.0, registry.release.set).start()  # if the second load is let through
    with pytest.raises(LoRAConflictError, match="'x' is being loaded by another request"):
        registry.add_folder("x", "/two")
    registry.release.set()
    first.join(30)
    assert results["first"].weights.path == "/one" and registry.get("x") is results["first"]
    registry.release.clear()
    registry.started.clear()
    threading.Thread(target=registry.add_folder, args=("y", "/y"), daemon=True).start()
    assert registry.started.wait(30)
    try:
        with pytest.raises(LoRACapacityError):  # x held, y loading: a load counts too
            registry.add_folder("z", "/z")
    finally:
        registry.release.set()
