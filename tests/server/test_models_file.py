"""The models file's checks, the router's weighted choice and the device turns, without
loading any model: each bad file names its problem; the split follows the weights within a
binomial bound; engines sharing a device alternate steps."""

import collections
import random
import threading
import time
import types
from pathlib import Path

import pytest

from jaxserve.fleet.device_turns import DeviceTurns
from jaxserve.fleet.models_file import read_models_file
from jaxserve.fleet.routing import RoutingTable, UnknownModelError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return path


GOOD = """
[[models]]
name = "austen"
version = 2
path = "austen-v2"
weight = 10
max_num_seqs = 8
devices = [1]
fallback = "austen@1"

[[models]]
name = "austen"
path = "/abs/austen-v1"

[[models]]
name = "tiny"
version = "a"
path = "tiny"
fallback = "austen"
"""


def test_a_good_file(tmp_path):
    entries = read_models_file(write(tmp_path, GOOD), num_devices=2)
    assert [e.pinned_id for e in entries] == ["austen@2", "austen@1", "tiny@a"]
    first = entries[0]
    assert first.weight == 10 and entries[1].weight == 100  # the default weight
    assert first.path == str(tmp_path / "austen-v2")  # relative to the file's folder
    assert entries[1].path == "/abs/austen-v1"
    assert first.options() == {"max_num_seqs": 8, "devices": (1,)}
    assert first.fallback == "austen@1" and entries[2].fallback == "austen"


def test_an_adapter_version_names_its_base_and_folder(tmp_path):
    entries = read_models_file(write(tmp_path, GOOD + """
[[models]]
name = "austen"
version = 3
base = "austen@1"
lora_path = "adapters/v3"
weight = 5
fallback = "austen@1"
"""))
    adapter = entries[-1]
    assert adapter.is_adapter and not entries[0].is_adapter
    assert (adapter.base, adapter.weight, adapter.fallback) == ("austen@1", 5, "austen@1")
    assert adapter.lora_path == "adapters/v3"  # nothing beside the file: a Hub id
    (tmp_path / "adapters" / "v3").mkdir(parents=True)
    beside = read_models_file(tmp_path / "models.toml")[-1]
    assert beside.lora_path == str(tmp_path / "adapters" / "v3")
    assert adapter.engine_definition() == ("austen@1", adapter.lora_path)


def test_presets_by_name_and_hub_ids_are_kept_as_given(tmp_path):
    """A `config` naming a shipped preset and a `path` that is a Hub id stay as written when
    nothing of that name is beside the file; a file beside it wins."""
    text = ('[[models]]\nname = "a"\npath = "acme/tiny-llama@v1"\nconfig = "cpu"\n'
            '[[models]]\nname = "b"\npath = "b"\nconfig = "my.toml"\n')
    (tmp_path / "b").mkdir()
    a, b = read_models_file(write(tmp_path, text), num_devices=1)
    assert (a.path, a.config) == ("acme/tiny-llama@v1", "cpu")
    assert (b.path, b.config) == (str(tmp_path / "b"), str(tmp_path / "my.toml"))


BAD = {
    "duplicate pinned id": ("""
[[models]]
name = "a"
path = "x"
[[models]]
name = "a"
version = "1"
path = "y"
""", "repeats the pinned id 'a@1'"),
    "unknown fallback": ("""
[[models]]
name = "a"
path = "x"
fallback = "b"
""", "fallback 'b' is not a model name or pinned id"),
    "fallback cycle": ("""
[[models]]
name = "a"
path = "x"
fallback = "b@1"
[[models]]
name = "b"
path = "y"
fallback = "c"
[[models]]
name = "c"
path = "z"
fallback = "a"
""", "fallback cycle a@1 -> b@1 -> c@1 -> a@1"),
    "fallback to its own name": ("""
[[models]]
name = "a"
path = "x"
fallback = "a"
""", "fallback names the entry itself"),
    "fallback to a sibling version that falls back to the name": ("""
[[models]]
name = "a"
path = "x"
fallback = "a@2"
[[models]]
name = "a"
version = "2"
path = "y"
fallback = "b"
[[models]]
name = "b"
path = "z"
fallback = "a"
""", "fallback cycle"),
    "devices out of range": ("""
[[models]]
name = "a"
path = "x"
devices = [0, 2]
""", "devices [2] are out of range (this host has 2 device(s), 0 to 1)"),
    "weights all 0": ("""
[[models]]
name = "a"
path = "x"
weight = 0
[[models]]
name = "a"
version = "2"
path = "y"
weight = 0
""", "every version of 'a' has weight 0"),
    "unknown field": ("""
[[models]]
name = "a"
path = "x"
max_num_seq = 4
""", "unknown field(s) ['max_num_seq']"),
    "@ in a name": ("""
[[models]]
name = "a@b"
path = "x"
""", "models[0].name 'a@b' may not contain '@'"),
    "negative weight": ("""
[[models]]
name = "a"
path = "x"
weight = -1
""", "weight must be a number >= 0"),
    "no path": ("""
[[models]]
name = "a"
""", "path: a model folder is required"),
    "an adapter on an unknown base": ("""
[[models]]
name = "a"
path = "x"
[[models]]
name = "a"
version = "2"
base = "a@3"
lora_path = "adapter"
""", "models[1] (a@2).base 'a@3' is not the pinned id of a model entry"),
    "an adapter on an adapter": ("""
[[models]]
name = "a"
path = "x"
[[models]]
name = "a"
version = "2"
base = "a@1"
lora_path = "adapter"
[[models]]
name = "a"
version = "3"
base = "a@2"
lora_path = "adapter"
""", "models[2] (a@3).base 'a@2' is not the pinned id of a model entry"),
    "an adapter with engine options": ("""
[[models]]
name = "a"
path = "x"
[[models]]
name = "a"
version = "2"
base = "a@1"
lora_path = "adapter"
max_num_seqs = 4
""", "['max_num_seqs'] cannot be set on an adapter version"),
    "an adapter without its folder": ("""
[[models]]
name = "a"
path = "x"
[[models]]
name = "a"
version = "2"
base = "a@1"
""", "models[1] (a@2).lora_path: an adapter version needs both"),
    "no entries": ("", "no [[models]] entries"),
    "not TOML": ("[[models]\n", "invalid TOML"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_files_name_their_problem(tmp_path, case):
    text, message = BAD[case]
    with pytest.raises(ValueError) as err:
        read_models_file(write(tmp_path, text), num_devices=2)
    assert message in str(err.value)
    assert "models.toml" in str(err.value)


def test_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_models_file(tmp_path / "nope.toml")


def fake_version(name: str, version: str, failure=None):
    """What the routing table reads of a served version."""
    return types.SimpleNamespace(pinned_id=f"{name}@{version}", failure=failure)


def table_of(tmp_path, text: str):
    entries = read_models_file(write(tmp_path, text))
    versions = [fake_version(e.name, e.version) for e in entries]
    return RoutingTable(list(zip(versions, entries))), versions


SPLIT = """
[[models]]
name = "a"
path = "x"
weight = 25
[[models]]
name = "a"
version = "2"
path = "y"
weight = 75
[[models]]
name = "a"
version = "3"
path = "z"
weight = 0
"""


def test_weighted_choice_follows_the_weights(tmp_path):
    table, (v1, v2, v3) = table_of(tmp_path, SPLIT)
    rng = random.Random(7)
    picks = collections.Counter(table.resolve("a", rng).served.pinned_id for _ in range(2000))
    # binomial(2000, 0.25): mean 500, standard deviation 19.4; 5 sigma either side
    assert abs(picks["a@1"] - 500) < 5 * 19.4 and picks["a@3"] == 0
    again = random.Random(7)  # seeded: the same sequence of choices
    rng = random.Random(7)
    assert [table.resolve("a", rng).served for _ in range(50)] == \
        [table.resolve("a", again).served for _ in range(50)]
    assert table.resolve("a@3", rng).served is v3  # a pinned id reaches weight 0 too
    assert table.resolve("a@3", rng).reason == "pinned"
    assert table.resolve(None, rng).served in (v1, v2)  # no model: the first name
    with pytest.raises(UnknownModelError, match="`b` does not exist"):
        table.resolve("b", rng)


def test_a_failed_version_is_skipped_while_another_is_healthy(tmp_path):
    table, (v1, v2, _) = table_of(tmp_path, SPLIT)
    v2.failure = "broken"
    rng = random.Random(0)
    assert {table.resolve("a", rng).served.pinned_id for _ in range(50)} == {"a@1"}
    v1.failure = "broken too"  # nothing healthy: the split as configured (they answer 500)
    assert {table.resolve("a", rng).served.pinned_id for _ in range(200)} == {"a@1", "a@2"}


def test_engines_sharing_a_device_alternate_steps():
    """Two engines step as fast as they can on device 0; a third runs on device 1. While
    both wait for device 0 they alternate (an engine takes two turns in a row only if the
    other had not queued yet); the third never waits for them."""
    turns, order, lock = DeviceTurns(), [], threading.Lock()
    stop = threading.Event()

    def engine(name: str, devices, step_seconds: float):
        while not stop.is_set():
            with turns.turn(devices):
                with lock:
                    order.append(name)
                time.sleep(step_seconds)

    threads = [threading.Thread(target=engine, args=("busy", [0], 0.004)),
               threading.Thread(target=engine, args=("quiet", [0], 0.001)),
               threading.Thread(target=engine, args=("apart", [1], 0.001))]
    for t in threads:
        t.start()
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join()
    shared = [name for name in order if name != "apart"][2:]  # after both are waiting
    repeats = sum(a == b for a, b in zip(shared, shared[1:]))
    # a repeat needs the waiting thread to be starved of the CPU for a whole turn
    assert len(shared) > 20 and repeats <= len(shared) // 10, shared[:40]
    # the device-1 engine ran its own pace: more steps than either device-0 engine
    assert order.count("apart") > max(order.count("busy"), order.count("quiet"))


def test_the_devices_option_places_an_engines_mesh():
    """`devices` picks local devices for the mesh (conftest gives 8 host devices)."""
    import jax

    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.engine_setup import engine_mesh

    mesh = engine_mesh(EngineConfig(devices=(3, 5), tensor_parallel_size=2))
    assert [d.id for d in mesh.devices.flat] == [jax.local_devices()[i].id for i in (3, 5)]
    with pytest.raises(ValueError, match=r"devices \[9\] are out of range"):
        engine_mesh(EngineConfig(devices=(9,)))
    with pytest.raises(ValueError, match="needs 2"):
        EngineConfig(devices=(0,), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="lists a device twice"):
        EngineConfig(devices=(1, 1), tensor_parallel_size=2)
