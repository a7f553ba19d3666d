"""The serving engine: continuous batching over a paged KV cache.

One request's path through this package (the server and `LLM` both enter at `Engine`):

1. `engine.Engine.add_request` validates it into a `sequence.Sequence` and queues it; the
   next `step()` hands it to the least-loaded replica's `scheduler.Scheduler`.
2. `Scheduler.schedule()` picks this step's work under the token budget (decode tokens first,
   then prefill chunks), reserving pages from `page_allocator.PageAllocator` (which also
   finds cached prefixes); an all-decode step in which nobody streams (`output_kind`
   "final_only") becomes a multi-step decode loop.
3. `batcher.build_step_input` pads the step to a (tokens, sequences) bucket as numpy arrays.
4. `runner.Runner` packs them into one buffer (`packing`, one host→device copy) and runs
   that bucket's program, compiled at warm-up: the model
   (`jaxserve.model`) with the attention backend's per-step function
   (`jaxserve.attention`), K/V written into the donated cache (`kv_cache`), then
   `jaxserve.sampling.sampler` on device. One host copy brings the sampled tokens back.
5. A single step is booked as it is dispatched (`Scheduler.advance`: the token it will
   sample is a placeholder), so the next `step()` can schedule and dispatch the next step
   before reading this one's tokens; the device reads the placeholder tokens itself.
   `Scheduler.complete` (a decode loop: `postprocess`) fills in the tokens, checks stop
   tokens and length, keys full pages for the prefix cache and frees finished pages.
   A request under a grammar (structured output) books each token with its
   `sequence.GrammarState`, whose next bitmask the sampler applies on device; such a step
   is read before the next one is dispatched, and never runs as a multi-step loop. Prompt
   log-probabilities are scored by the step program beside the sampled tokens.
6. `output_processor.OutputProcessor` detokenizes, finds stop strings (the engine then calls
   `Scheduler.stop_early`) and returns a `StreamDelta`; `metrics` records the step and every
   finished request, and `Engine.stats()` reports queue lengths and cache usage.

`jaxserve.config.engine.EngineConfig` holds the options; `replica` is one data-parallel
replica and its step on device; `multihost` broadcasts each step's input from process 0 to
the others. The scheduler, allocator, sequence and batcher are plain Python and numpy;
everything that touches jax is in the runner and its programs, the cache and the engine.
`async_engine` runs the engine on a thread for asyncio callers (the server, the fleet),
`prometheus` exports its metrics.
"""
