"""`jaxserve bench offline --baseline vllm` runs vLLM-CPU as its users run it fast: OpenMP
threads bound to every core jaxserve may use, the KV space explicit, and what the user set
in the environment kept (hand-written cases)."""

import pytest

from jaxserve.bench.offline_bench import core_ranges, vllm_cpu_env

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("cores, spelled", [({0, 1}, "0-1"), ({0}, "0"),
                                            ({0, 1, 2, 5}, "0-2,5"), ({3, 7, 8, 9}, "3,7-9")])
def test_cores_are_spelled_as_openmp_bind_lists(cores, spelled):
    assert core_ranges(cores) == spelled


def test_vllm_binds_every_core_and_sizes_its_kv_space():
    assert vllm_cpu_env({}, {0, 1}, 4.0) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                            "VLLM_CPU_KVCACHE_SPACE": "4"}
    mine = {"VLLM_CPU_OMP_THREADS_BIND": "1", "PATH": "x"}
    assert vllm_cpu_env(mine, {0, 1}, 2.5) == {"VLLM_CPU_OMP_THREADS_BIND": "1",
                                              "VLLM_CPU_KVCACHE_SPACE": "2.5"}
