"""`jaxserve plan`: a preset's programs compiled for its TPU/GPU on this CPU host, and the
memory arithmetic checked against numbers computed here from the model's shapes alone."""

import contextlib
import io
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import pallas_kernels
from jaxserve.aot.plan import compile_program
from jaxserve.aot.report import format_plan
from jaxserve.engine.cache_audit import PagePools
from jaxserve.aot.targets import TPU_KINDS, Target, compile_only_devices
from jaxserve.cli.main import main
from sweeps import sweep

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]
# A small Llama whose head_dim (128) the kernels take; only config.json, no weights.
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1024,
            hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=128,
            max_position_embeddings=1024, rms_norm_eps=1e-5, torch_dtype="bfloat16")
PRESET = """
[hardware]
platform = "{platform}"
devices = 1
accelerator = "{accelerator}"
[model]
dtype = "bfloat16"
max_model_len = 512
[kv_cache]
page_size = 16
kv_cache_memory_fraction = 0.5
[batching]
max_num_seqs = 8
max_num_batched_tokens = 64
num_decode_steps = 4
token_buckets = [16, 64]
seq_buckets = [1, 8]
"""


def run_plan(*argv) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", *map(str, argv), "--json"])
    return code, json.loads(out.getvalue())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_config_only")
    (folder / "config.json").write_text(json.dumps(TINY))
    return folder


def tiny_moe_on_four_chips(tmp_path: Path, width: int, platform: str = "tpu",
                           accelerator: str = "v6e") -> tuple[Path, Path]:
    """A config-only Qwen3-MoE (8 experts of `width` columns) and a preset of 4 devices of
    `accelerator`: (model folder, preset file)."""
    model = tmp_path / "moe"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        **TINY, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": width}))
    preset = tmp_path / f"{platform}.toml"
    preset.write_text(PRESET.format(platform=platform, accelerator=accelerator).replace(
        "devices = 1", "devices = 4"))
    return model, preset


def tiny_weight_bytes() -> int:
    e, i, v, hq, hkv, d, layers = (TINY[k] for k in (
        "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_hidden_layers"))
    per_layer = e * hq * d * 2 + e * hkv * d * 2 + 3 * e * i + 2 * e
    return 2 * (2 * v * e + e + layers * per_layer)  # bfloat16


@pytest.mark.parametrize("platform,accelerator", [("tpu", "v5e"), ("gpu", "h100")])
def test_plan_compiles_and_fits(tiny, tmp_path, platform, accelerator):
    preset = tmp_path / "tiny.toml"
    preset.write_text(PRESET.format(platform=platform, accelerator=accelerator))
    code, plan = run_plan("--config", preset, "--model", tiny, "--verbose", "--buckets", "all")
    assert code == 0, plan["reason"]
    assert plan["fits"] and plan["platform"] == platform and plan["devices"] == 1
    if platform == "tpu":
        hbm = TPU_KINDS["v5e"].hbm_bytes
    else:  # JAX's GPU allocator takes 0.75 of the card's memory
        spec = (REPO / "jaxserve/aot/gpu_targets/h100.txtpb").read_text()
        hbm = int(int(spec.split("device_memory_size:")[1].split()[0]) * 0.75)
    assert plan["hbm_bytes_per_device"] == hbm
    assert plan["weights_bytes_per_device"] == tiny_weight_bytes()
    page = 2 * TINY["num_hidden_layers"] * 16 * TINY["num_key_value_heads"] * 128 * 2
    pages = int((hbm - tiny_weight_bytes()) * 0.5) // page
    assert plan["num_pages"] == pages
    assert plan["kv_cache_bytes_per_device"] == pages * page
    assert plan["max_concurrent_tokens"] == (pages - 1) * 16
    shapes = [(p["name"], p["tokens"], p["seqs"]) for p in plan["programs"]]
    assert shapes == [("step", 16, 1), ("step", 16, 8), ("step", 64, 1), ("step", 64, 8),
                      ("decode", 1, 1), ("decode", 8, 8)]
    for program in plan["programs"]:  # every bucket: the cache guard (`cache_audit`) holds
        assert program["compiled"] and program["cache_donated"], program
        assert program["cache_copies"] == program["cache_whole_pool_ops"] == 0, program
        assert program["compile_seconds"] > 0
        assert program["peak_bytes"] >= plan["weights_bytes_per_device"] + pages * page
    assert plan["max_temp_bytes_per_device"] == max(p["temp_bytes"] for p in plan["programs"])
    if platform == "gpu":  # --verbose: ptxas' view of the Triton kernels
        # a mixed step runs both kernels, the decode loop only the decode kernel (one
        # sequence: split over the keys, so its partials' combine kernel too)
        names = [sorted(k["name"] for k in p["kernels"]) for p in plan["programs"]]
        assert names[0] == ["decode_attention_triton", "decode_combine_triton",
                            "prefill_attention_triton"]
        assert names[4] == ["decode_attention_triton", "decode_combine_triton"]
        for kernel in plan["programs"][0]["kernels"]:
            assert 0 < kernel["registers"] <= 255 and kernel["spill_store_bytes"] >= 0
            assert 0 < kernel["shared_memory_bytes"] <= 232448


@pytest.mark.parametrize("platform,accelerator,method", sweep(
    [("tpu", "v5e", "draft_model"), ("gpu", "h100", "draft_model"), ("tpu", "v5e", "ngram"),
     ("gpu", "h100", "eagle3")], keep={0}))
def test_speculative_programs_compile_for_the_target(tiny, tmp_path, platform, accelerator,
                                                     method):
    """A preset's [speculative] table: its decode programs are speculative rounds (drafts
    proposed by a draft model or looked up, verified through the target's ragged kernel),
    compiled for the TPU/GPU, and they update both KV pools in place as every program must;
    the draft's weights and its KV pool count in the plan."""
    draft = dict(TINY, num_hidden_layers=1, hidden_size=256, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=512)
    if method == "eagle3":  # a head of the target's width over a draft vocabulary of 300
        draft = dict(TINY, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=512, architectures=["LlamaForCausalLMEagle3"],
                     draft_vocab_size=300, eagle_aux_hidden_state_layer_ids=[0, 1, 1])
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(draft))
    table = f'[speculative]\nmethod = "{method}"\nnum_speculative_tokens = 3\n'
    if method != "ngram":
        table += f'model = "{tmp_path / "draft"}"\n'
    preset = tmp_path / "spec.toml"
    preset.write_text(PRESET.format(platform=platform, accelerator=accelerator) + table)
    code, plan = run_plan("--config", preset, "--model", tiny)
    assert code == 0, plan["reason"]
    shapes = [(p["name"], p["tokens"], p["seqs"]) for p in plan["programs"]]
    assert ("spec", 1, 1) in shapes and ("spec", 8, 8) in shapes
    assert not any(name == "decode" for name, _, _ in shapes)
    for program in plan["programs"]:
        assert program["compiled"] and program["cache_donated"], program
        assert program["cache_copies"] == program["cache_whole_pool_ops"] == 0, program
    if method == "draft_model":  # bfloat16 weights; a page of both pools (16 tokens, K and V)
        d_e, d_i, v = draft["hidden_size"], draft["intermediate_size"], draft["vocab_size"]
        d_layer = d_e * 2 * 128 * 2 + d_e * 1 * 128 * 2 + 3 * d_e * d_i + 2 * d_e
        assert plan["weights_bytes_per_device"] == tiny_weight_bytes() + 2 * (
            2 * v * d_e + d_e + d_layer)
        page = 2 * 16 * 128 * 2 * (TINY["num_hidden_layers"] * TINY["num_key_value_heads"] + 1)
        assert plan["kv_cache_bytes_per_device"] == plan["num_pages"] * page
    if method == "eagle3":  # fc, norms, [2E]-wide q/k/v, o, MLP, lm head; d2t in int32
        e, i, d = TINY["hidden_size"], 512, 128
        head = (3 * e * e + 4 * e + 2 * e * 2 * d + 2 * (2 * e * 1 * d) + 2 * d * e + 3 * e * i
                + e * 300)
        assert plan["weights_bytes_per_device"] == tiny_weight_bytes() + 2 * head + 4 * 300
        page = 2 * 16 * 128 * 2 * (TINY["num_hidden_layers"] * TINY["num_key_value_heads"] + 1)
        assert plan["kv_cache_bytes_per_device"] == plan["num_pages"] * page


@pytest.mark.slow  # compiles a TPU and a GPU ladder: CI's slow step, with the presets' plans
@pytest.mark.parametrize("platform,accelerator", [("tpu", "v5e"), ("gpu", "h100")])
def test_lora_slots_compile_for_the_target_and_count_in_the_plan(tiny, tmp_path, platform,
                                                                   accelerator):
    """A preset's [lora] table: every program takes the adapter slots' stacks (3 slots of
    rank 8 over the seven projections, bfloat16) and still updates the cache in place; the
    stacks count beside the weights, before the KV cache takes its share."""
    preset = tmp_path / "lora.toml"
    preset.write_text(PRESET.format(platform=platform, accelerator=accelerator)
                      + "[lora]\nenable_lora = true\nmax_loras = 3\nmax_lora_rank = 8\n")
    code, plan = run_plan("--config", preset, "--model", tiny, "--buckets", "largest")
    assert code == 0, plan["reason"]
    e, i, q, kv = 512, 1024, 4 * 128, 2 * 128
    per_layer = sum(n_in + n_out for n_in, n_out in [(e, q), (e, kv), (e, kv), (q, e), (e, i),
                                                     (e, i), (i, e)])
    lora = 2 * TINY["num_hidden_layers"] * 3 * 8 * per_layer
    assert plan["lora_slots_bytes_per_device"] == lora
    assert plan["weights_bytes_per_device"] == tiny_weight_bytes() + lora
    for program in plan["programs"]:
        assert program["compiled"] and program["cache_donated"], program
        assert program["cache_copies"] == program["cache_whole_pool_ops"] == 0, program


def test_oversized_plan_exits_1_with_the_numbers():
    code, plan = run_plan("--config", REPO / "tpu_configs/v5e-1.toml", "--model",
                          "llama-3.1-70b")
    assert code == 1 and plan["fits"] is False
    assert plan["weights_bytes_per_device"] > 130 * GIB > plan["hbm_bytes_per_device"]
    assert "weights take" in plan["reason"] and plan["programs"] == []


def test_usage_errors_exit_2(tiny, capsys):
    assert main(["plan", "--model", str(tiny)]) == 2  # no preset
    assert main(["plan", "--config", str(REPO / "jaxserve/presets/cpu.toml")]) == 2
    assert "plans are for tpu and gpu presets" in capsys.readouterr().err


def test_a_program_that_copies_the_cache_fails_the_donation_check():
    devices = compile_only_devices(Target("tpu", "v5e", 1))
    sh = NamedSharding(Mesh(np.array(devices), ("x",)), P())
    cache = jax.ShapeDtypeStruct((64, 16, 8, 128), jnp.bfloat16, sharding=sh)
    new = jax.ShapeDtypeStruct((16, 8, 128), jnp.bfloat16, sharding=sh)
    write = lambda c, x: c.at[3].set(x)  # noqa: E731
    cache_bytes = math.prod(cache.shape) * 2
    copied = compile_program(jax.jit(write), [cache, new], "write", 16, 1, cache_bytes, "tpu")
    donated = compile_program(jax.jit(write, donate_argnums=0), [cache, new], "write", 16, 1,
                              cache_bytes, "tpu")
    assert copied.compiled and not copied.cache_donated
    assert donated.compiled and donated.cache_donated
    assert copied.peak_bytes > donated.peak_bytes + cache_bytes // 2  # the copy costs memory


def test_the_copy_check_counts_page_pools_and_int8_scale_pools():
    """`PagePools.of` takes the pages and the int8 scale pools as long as them (not fp8's
    scales per layer and kv head); a decode program over a 64-float scale row, which XLA:TPU
    lays out pages-minor, shows the two copies (K's and V's scales) in `cache_copies`."""
    devices = compile_only_devices(Target("tpu", "v6e", 1))
    sh = NamedSharding(Mesh(np.array(devices), ("x",)), P())
    pages = jax.ShapeDtypeStruct((4096, 64, 128), jnp.int8, sharding=sh)
    scales = jax.ShapeDtypeStruct((4096, 64), jnp.float32, sharding=sh)  # 1 head, unpadded
    head_scales = jax.ShapeDtypeStruct((2, 64), jnp.float32, sharding=sh)
    pools = PagePools.of(([(pages, pages, scales, scales), (head_scales,)], 1))
    assert set(pools.shapes) == {(4096, 64, 128), (4096, 64)} and len(pools.shapes) == 4
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sh) for shape, dtype in
            (((8, 4, 128), jnp.bfloat16), ((8,), jnp.int32), ((8, 16), jnp.int32))]
    decode = jax.jit(lambda q, lens, table, k, v, ks, vs: pallas_kernels.paged_attention(
        q, k, v, lens, table, k_scales=ks, v_scales=vs))
    report = compile_program(decode, args + [pages, pages, scales, scales], "decode", 8, 8,
                             0, "tpu", pools=pools)
    assert report.compiled and report.cache_copies == 2


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "loop"])
def test_stacked_layers_lower_one_copy_of_the_layer(scan_layers):
    """Why compile time no longer grows with depth: with `scan_layers` the TPU program calls
    the attention kernel (and every other per-layer function, e.g. silu) once, inside the
    scan, whatever the depth; the layer loop calls them once per layer."""
    from jaxserve.model.hf_config import config_from_hf
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.runner import Runner
    from jaxserve.loading.weights import abstract_sharded_model
    import sharding

    mesh = sharding.make_mesh(1, 1, compile_only_devices(Target("tpu", "v5e", 1)))
    engine = EngineConfig(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=16,
                          num_decode_steps=2, scan_layers=scan_layers)
    kernel_calls = []
    for layers in (2, 6):
        cfg = config_from_hf({**TINY, "num_hidden_layers": layers})
        model = abstract_sharded_model(cfg, jnp.bfloat16, mesh, scan_layers)
        jitted, args = Runner(model, engine, 64, mesh, "tpu").program_inputs("step", 16, 2)
        text = jitted.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        kernel_calls.append(text.count("call @attention(") + text.count("call @silu("))
    if scan_layers:
        assert kernel_calls[0] == kernel_calls[1] >= 1
    else:
        assert kernel_calls[1] == 3 * kernel_calls[0]


def tiny_int8_weight_bytes() -> int:
    """int8 codes of every kernel, the embedding and the lm head, one float32 scale per output
    channel, bfloat16 norms."""
    e, i, v, hq, hkv, d, layers = (TINY[k] for k in (
        "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_hidden_layers"))
    codes = e * hq * d * 2 + e * hkv * d * 2 + 3 * e * i  # q, o; k, v; gate, up, down
    scales = hq * d + 2 * hkv * d + e + 2 * i + e  # q; k, v; o; gate, up; down
    per_layer = codes + 4 * scales + 2 * 2 * e  # and two norms
    return 2 * v * e + 4 * 2 * v + 2 * e + layers * per_layer


@pytest.mark.parametrize("platform,accelerator,kv", sweep([("tpu", "v5e", "fp8"),
                                                           ("tpu", "v6e", "int8"),
                                                           ("gpu", "h100", "int8")], keep={1}))
def test_quantized_plan_compiles_with_its_bytes(tiny, tmp_path, platform, accelerator, kv):
    """int8 weights and an 8-bit KV cache compile for TPU and GPU; weights and pages as
    computed here from the shapes (int8 pages add a float32 scale per token and head,
    padded on TPU: `kv_quant.scale_stride`)."""
    preset = tmp_path / "tiny.toml"
    preset.write_text(PRESET.format(platform=platform, accelerator=accelerator))
    code, plan = run_plan("--config", preset, "--model", tiny, "--quantization", "int8",
                          "--kv-cache-dtype", kv, "--num-pages", 64)
    assert code == 0, plan["reason"]
    assert plan["quantization"] == "int8" and plan["weights_bytes_per_device"] == \
        tiny_int8_weight_bytes()
    # int8 scales: 4 bytes a token and head; on TPU the 2 heads' runs of 16 (32 floats a
    # page) are padded to 64 each so the row is 128 floats: 16 bytes
    per_token_head = 128 + ((16 if platform == "tpu" else 4) if kv == "int8" else 0)
    page = 2 * TINY["num_hidden_layers"] * 16 * TINY["num_key_value_heads"] * per_token_head
    assert plan["kv_cache_bytes_per_device"] == plan["num_pages"] * page
    assert all(p["compiled"] and p["cache_donated"] for p in plan["programs"])


def test_quantized_experts_plan_compiles_with_their_bytes(tmp_path):
    """A Qwen3-MoE with int8 weights compiles for TPU (megablox `gmm` on the experts' widened
    codes); its weights are the dense model's minus the MLP, plus per layer the router
    (bfloat16), each expert's codes with a float32 scale per expert and output channel, and
    Qwen3's q/k norms."""
    x, m = 8, 256
    moe = {**TINY, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "num_experts": x, "num_experts_per_tok": 2, "moe_intermediate_size": m}
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps(moe))
    preset = tmp_path / "tiny.toml"
    preset.write_text(PRESET.format(platform="tpu", accelerator="v6e"))
    code, plan = run_plan("--config", preset, "--model", tmp_path / "moe", "--quantization",
                          "int8", "--num-pages", 64, "--buckets", "largest")
    assert code == 0, plan["reason"]
    e, i = TINY["hidden_size"], TINY["intermediate_size"]
    dense_mlp = 3 * e * i + 4 * (2 * i + e)  # codes, scales
    experts = 2 * e * x + 3 * x * e * m + 4 * x * (2 * m + e)  # router, codes, scales
    qk_norms = 2 * 2 * TINY["head_dim"]
    assert plan["weights_bytes_per_device"] == tiny_int8_weight_bytes() + TINY[
        "num_hidden_layers"] * (experts - dense_mlp + qk_norms)
    assert all(p["compiled"] for p in plan["programs"])


@pytest.mark.parametrize("kv_heads,devices", sweep([(2, 1), (1, 1), (4, 4)], keep={1}))
def test_a_plan_reads_the_page_pool_in_place_with_head_dim_64(tmp_path, kv_heads, devices):
    """head_dim 64 on TPU: two kv heads per device make a 128-lane page row, which XLA keeps
    row-major and the kernels read in place. One kv head's 64 values were laid out
    pages-minor and copied into the kernels' layout on every call (this plan failed naming
    the copy); its pages now hold two tokens a row (`kv_quant.tokens_per_row`), 128 lanes,
    and no program copies the pool; so do four heads split over four devices. (Sized from all
    of the HBM, the copies did not even fit. 4000 pages keep the compile small.)"""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {**TINY, "num_key_value_heads": kv_heads, "head_dim": 64}))
    preset = tmp_path / "tiny.toml"
    preset.write_text(PRESET.format(platform="tpu", accelerator="v6e").replace(
        "devices = 1", f"devices = {devices}") + f"[mesh]\ntensor_parallel_size = {devices}\n")
    code, plan = run_plan("--config", preset, "--model", folder, "--buckets", "largest",
                          "--num-pages", 4000)
    assert [p["cache_copies"] for p in plan["programs"]] == [0, 0]
    assert code == 0, plan["reason"]


def test_a_plan_reads_int8_scale_pools_in_place(tmp_path):
    """int8 pages of 16 tokens with 2 kv heads: a scale row of 32 floats, which XLA:TPU laid
    out pages-minor and copied on every call; each head's run padded to 64 floats
    (`kv_quant.scale_stride`) makes the row 128, and neither pages nor scales are copied. The
    plan counts copies of the scale pools with the pages'."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    preset = tmp_path / "tiny.toml"
    preset.write_text(PRESET.format(platform="tpu", accelerator="v6e").replace(
        "[kv_cache]", '[kv_cache]\nkv_cache_dtype = "int8"'))
    code, plan = run_plan("--config", preset, "--model", folder, "--buckets", "largest",
                          "--num-pages", 4000)
    assert [p["cache_copies"] for p in plan["programs"]] == [0, 0]
    assert code == 0, plan["reason"]


def test_gpu_memory_utilization_sizes_the_pool_after_compiling(tiny, tmp_path):
    """An H100's 0.75 x 80 GiB allocator limit, half of it to this engine: the pool is that
    less the weights (computed from the shapes), the largest program's temporaries and
    unaliased outputs (measured on programs compiled for a one-sequence pool), and 2% of the
    limit. The programs compiled for the real pool need no more than that plus the margin:
    XLA:GPU gives the 8-row decode loop a few MiB more temporaries beside a large pool (see
    docs/plans.md), which the margin absorbs."""
    preset = tmp_path / "tiny.toml"
    preset.write_text(PRESET.format(platform="gpu", accelerator="h100").replace(
        "kv_cache_memory_fraction = 0.5", "gpu_memory_utilization = 0.5"))
    code, plan = run_plan("--config", preset, "--model", tiny, "--buckets", "largest")
    assert code == 0, plan["reason"]
    spec = (REPO / "jaxserve/aot/gpu_targets/h100.txtpb").read_text()
    limit = int(int(spec.split("device_memory_size:")[1].split()[0]) * 0.75)
    budget = plan["memory_budget"]
    margin = int(0.02 * limit)
    page = 2 * TINY["num_hidden_layers"] * 16 * TINY["num_key_value_heads"] * 128 * 2
    pool = limit // 2 - tiny_weight_bytes() - budget["temp_bytes"] - margin
    assert budget["kv_cache_bytes"] == pool and budget["margin_bytes"] == margin
    assert plan["num_pages"] == pool // page
    needs = {(p["name"], p["tokens"], p["seqs"]): p["temp_bytes"] + p["output_bytes"]
             for p in plan["programs"]}
    assert budget["temp_bytes"] >= needs["step", 64, 8] > 0  # the step's are the same
    assert max(needs.values()) <= budget["temp_bytes"] + margin
    text = format_plan(plan)
    assert (f"KV cache sized after compiling: {limit / GIB:.2f} GiB x gpu_memory_utilization "
            "0.5 - ") in text
    assert f"-> {pool // page} pages" in text


def test_a_failing_plan_of_experts_split_column_wise_suggests_expert_parallelism(tmp_path):
    """A Qwen3-MoE over 4 TPU chips without expert parallelism whose plan does not fit (a
    pool of 10 million pages, more than a chip holds): the reason says each chip holds a
    128-column slice of every expert (512 / 4) and names expert parallelism; with it, the
    same plan's reason does not."""
    model, preset = tiny_moe_on_four_chips(tmp_path, 512)
    argv = ("--config", preset, "--model", model, "--tensor-parallel-size", 4,
            "--num-pages", 10**7, "--buckets", "largest")
    code, plan = run_plan(*argv)
    assert code == 1 and plan["fits"] is False
    assert ("each device holds a 128-column slice of every expert (512 / 4)"
            in plan["reason"]) and "--enable-expert-parallel" in plan["reason"]
    code, plan = run_plan(*argv, "--enable-expert-parallel")
    assert code == 1 and plan["reason"] and "expert" not in plan["reason"]


@pytest.mark.parametrize("pinned", [True, False])
def test_experts_split_column_wise_are_read_in_place_on_tpu(tmp_path, monkeypatch, pinned):
    """A Qwen3-MoE over 4 TPU chips with tensor-parallel experts (asked for: by default
    these go whole to the chips), each chip's slice 96 columns wide (384 / 4, under the 128
    lanes): XLA:TPU would take the gate and up stacks with their 512-wide axis minor, and the
    decode loop would copy both whole (hoisted out of the loop). With the layouts XLA chooses
    for the loop pinned (`jaxserve.engine.weight_layouts`), no program copies a weight;
    without (the defect put back), the decode loop copies two."""
    if not pinned:
        monkeypatch.setattr("jaxserve.engine.weight_layouts.PINNED_PLATFORMS", ())
    model, preset = tiny_moe_on_four_chips(tmp_path, 384)
    code, plan = run_plan("--config", preset, "--model", model,
                          "--tensor-parallel-size", 4, "--no-enable-expert-parallel",
                          "--buckets", "largest")
    assert code == 0, plan["reason"]
    copies = {p["name"]: p["weight_copies"] for p in plan["programs"]}
    assert copies == ({"step": 0, "decode": 0} if pinned else {"step": 0, "decode": 2})


@pytest.mark.parametrize("width, chosen", [(384, True), (512, False)])
def test_expert_parallelism_is_chosen_on_tpu_for_experts_narrower_than_the_lanes(
        tmp_path, width, chosen):
    """Left unset, `enable_expert_parallel` turns on for a TPU plan whose experts' slices
    would not be whole 128-lane tiles (384 / 4 = 96 columns) and stays off when they would
    (512 / 4 = 128); the same 384-wide model on a GPU keeps its slices, and an explicit
    `--no-enable-expert-parallel` is obeyed."""
    model, tpu = tiny_moe_on_four_chips(tmp_path, width)
    _, gpu = tiny_moe_on_four_chips(tmp_path, width, "gpu", "h100")
    argv = ("--model", model, "--tensor-parallel-size", 4, "--buckets", "largest")
    code, plan = run_plan("--config", tpu, *argv)
    assert code == 0 and plan["expert_parallel"] is chosen
    if chosen:
        code, plan = run_plan("--config", tpu, *argv, "--no-enable-expert-parallel")
        assert code == 0 and plan["expert_parallel"] is False
        code, plan = run_plan("--config", gpu, *argv)
        assert code == 0 and plan["expert_parallel"] is False
