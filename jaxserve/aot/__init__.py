"""Ahead-of-time compilation for accelerators that are not attached: `jaxserve plan`.

  targets      compile-only TPU and GPU devices (libtpu topologies, GPU target configs)
  plan         build the engine as `serve` would, with abstract weights, compile its programs
               for the target and report per-device memory, fit and compile times
  gpu_kernels  registers, spills and shared memory of the Triton kernels (`plan --verbose`)
  report       the plan as a table for people (`--json` prints the dict itself)
"""
