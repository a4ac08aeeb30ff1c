"""Everything that decodes: greedy decoding with a target and, optionally, a drafter.

    types           Decoded (one response), the Proposer protocol, clock and finish
    families        what differs per target family (Llama, Qwen2/3, Qwen3-MoE, Mistral, Phi-3,
                    Gemma 3, gpt-oss): fused projections, norms, MoE blocks, per-layer windows
                    and RoPE tables, sinks, soft-capping; check_target (others: eager loop)
    static_models   StaticTarget / StaticDrafter: the models over fixed KV buffers
    engine          Engine: static caches, fixed-shape steps as CUDA graphs; a registry of step
                    families (Engine.register_steps) for plug-ins
    tree_search     DDTree's draft trees: best-first search (host and device), walk
    ddtree          DDTree verification on the engine; registers the "ddtree" step family
    lookup          prompt lookup: the n-gram proposer, its replay, the configuration sweep
    eager           the eager reference loop (DynamicCache), DFlashProposer; CPU fallback
    runner          Decoders: the methods evaluate compares, on the engine or the eager loop
    summary         metrics.json's figures from the responses (tau, speed, losslessness)
    concurrent      ConcurrentEngine: evaluate.concurrency's c sequences side by side on the
                    engine's models (continuous refill; c blocks drafted and c x B tokens
                    verified per step, each row accepting its own prefix)
    batched         BatchedEngine: regenerate's continuous batching, R rows over a static cache,
                    one captured decode step, finished rows refilled by gathered, packed prefills
    batched_step    its device work and shapes: decode inputs and layers (dense over a span, or
                    flex over each row's KV blocks), prefill packs, the token step; pack and
                    span sizes
    sampling        the batched engine's draws: per-answer seeded uniforms, temperature/top-k/p
    memory          what the batched engine's buffers take against the device's free memory
    hf_generate     transformers' generate() on padded batches: regenerate's fallback path

    evaluate ─► runner ─┬─► engine ──► static_models ──► families, tree_search
                        │     ▲
                        │     └── ddtree (registers its step family) ──► tree_search
                        ├─► eager ──► dflashpipe.taps (the same taps as extract)
                        └─► lookup
    evaluate ─► summary
    evaluate ─► concurrent ──► engine (its models, fused weights, tables), static_models, families
    regenerate ─┬─► batched ──► batched_step, families, static_models, sampling, memory
                └─► hf_generate (families the static models do not cover)
    engine, ddtree, eager, lookup, runner, summary ──► types

Lower layers never import a stage module (tests/test_imports.py): stages call in, results come
back as `Decoded`.
"""
