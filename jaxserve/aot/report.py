"""A plan (`jaxserve.aot.plan.build_plan`'s dict) as a table for people."""

from __future__ import annotations

from typing import Any

from jaxserve.aot.targets import GIB


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


def _hybrid_lines(plan: dict[str, Any]) -> list[str]:
    """The window pool of hybrid KV memory and what it buys, if the plan has one."""
    if not plan.get("window_layers"):
        return []
    return [f"  hybrid KV memory: {plan['window_layers']} window layers in a pool of "
            f"{plan['window_pool_pages']} pages ({_gib(plan['window_pool_bytes_per_device'])}"
            f"); full-length sequences that fit: {plan['max_seqs_at_max_model_len']}, "
            f"{plan['max_seqs_at_max_model_len_without_hybrid']} without it"]


def _budget_lines(plan: dict[str, Any]) -> list[str]:
    """How `gpu_memory_utilization` sized the KV cache after compiling, if it did."""
    budget = plan.get("memory_budget")
    if not budget:
        return []
    return [f"  KV cache sized after compiling: {budget['arithmetic']} -> "
            f"{plan['num_pages']} pages"]


def format_plan(plan: dict[str, Any], verbose: bool = False) -> str:
    """Header lines (target, memory per device, verdict), then one line per program."""
    lines = [
        f"{plan['preset']}: {plan['model']} ({plan['dtype']}"
        + (f", {plan['quantization']} weights" if plan.get("quantization") else "")
        + (", expert parallel" if plan.get("expert_parallel") else "")
        + f") on {plan['target']}, "
        f"{plan['devices']} device(s)",
        f"  per device: HBM {_gib(plan['hbm_bytes_per_device'])}, weights "
        f"{_gib(plan['weights_bytes_per_device'])}, KV cache "
        f"{_gib(plan['kv_cache_bytes_per_device'])} ({plan.get('kv_cache_dtype', '')} "
        f"{plan['num_pages']} pages, "
        f"{plan['max_concurrent_tokens']} tokens), largest temporaries "
        f"{_gib(plan['max_temp_bytes_per_device'])}",
        *_budget_lines(plan),
        *_hybrid_lines(plan),
        f"  programs: {plan['warm_up_programs']} compiled per replica at warm-up, "
        f"{len(plan['programs'])} of them here",
        f"  fits: {'yes' if plan['fits'] else 'NO'}"
        + (f" ({plan['reason']})" if plan["reason"] else ""),
    ]
    if plan["programs"]:
        lines.append(f"  {'program':<8} {'tokens':>6} {'seqs':>5} {'compile s':>9} "
                     f"{'temp':>10} {'peak':>10}  donated")
    for p in plan["programs"]:
        if not p["compiled"]:
            lines.append(f"  {p['name']:<8} {p['tokens']:>6} {p['seqs']:>5}  FAILED: {p['error']}")
            continue
        lines.append(f"  {p['name']:<8} {p['tokens']:>6} {p['seqs']:>5} "
                     f"{p['compile_seconds']:>9.1f} {_gib(p['temp_bytes']):>10} "
                     f"{_gib(p['peak_bytes']):>10}  {'yes' if p['cache_donated'] else 'NO'}"
                     + (f", copies a page pool {p['cache_copies']}x" if p.get("cache_copies")
                        else "")
                     + (f", {p['cache_whole_pool_ops']} other whole-pool op(s)"
                        if p.get("cache_whole_pool_ops") else "")
                     + (f", copies a weight {p['weight_copies']}x" if p.get("weight_copies")
                        else ""))
        if verbose and p.get("collectives"):
            lines.append("      collectives: " + ", ".join(
                f"{kind} {c['count']}x ({_gib(c['bytes'])})"
                for kind, c in p["collectives"].items()))
        for k in (p.get("kernels") or []) if verbose else []:
            lines.append(
                f"      {k['name']}: grid {k['grid']}, threads {k['threads'][0]}, "
                f"{k.get('registers', '?')} registers, {k.get('spill_store_bytes', '?')} B "
                f"spilled, {k['shared_memory_bytes']} B shared memory")
    return "\n".join(lines)
