"""Everything that decodes: greedy decoding with a target and, optionally, a drafter.

    types           Decoded (one response), the Proposer protocol, clock and finish
    families        what differs per target family (Llama, Qwen2/3, Qwen3-MoE, Mistral, Phi-3,
                    Gemma 3, gpt-oss): fused projections, norms, MoE blocks, per-layer windows
                    and RoPE tables, sinks, soft-capping; check_target (others: eager loop)
    layers          the one layer set: the target's and the drafter's step over N rows x Q
                    tokens against static KV buffers (dense over a span, flex over each row's
                    KV blocks, or a refill pack among its own tokens); step inputs and masks,
                    logits, the drafter's context rows, chain and tree candidates; a DFlash2
                    drafter's convolutions (drafter_layer) and selector walk (selected)
    packs           refill packs (whole prompts in one sequence), their lengths
    static_models   StaticTarget / StaticDrafter: buffers, fused weights, tables built once; the
                    loops over the layers; compiled() and capture()
    engine          Engine (c = 1): fixed-shape steps as CUDA graphs, acceptance; a registry of
                    step families (Engine.register_steps) for plug-ins
    tree_search     DDTree's draft trees: best-first search and walk on the device (the host
                    reference is tests/tree_reference.py)
    ddtree          DDTree verification on the engine; registers the "ddtree" step family
    concurrent      ConcurrentEngine: evaluate.concurrency's c rows side by side (continuous
                    refill; c blocks drafted and c x B tokens verified per step)
    batched         BatchedEngine: regenerate's continuous batching, R rows x 1 token, one
                    captured decode step, finished rows refilled by gathered packs
    batched_step    its token step: decode state, greedy or sampled choice, stops (`advance`)
    sampling        the batched engine's draws: per-answer seeded uniforms, temperature/top-k/p
    memory          what the row engines' buffers take against the device's free memory
    lookup          prompt lookup: the n-gram proposer, its replay, the configuration sweep
    eager           the eager reference loop (DynamicCache), DFlashProposer; CPU fallback
    runner          Decoders: the methods evaluate compares, on the engine or the eager loop
    summary         metrics.json's figures from the responses (tau, speed, losslessness)
    hf_generate     transformers' generate() on padded batches: regenerate's fallback path

    evaluate ─► runner ─┬─► engine ─────────┐   engines: schedulers (what runs each step,
                        │     ▲             │   refills, acceptance), no layer code
                        │     └── ddtree ──►├─► static_models ──► layers ──► families
                        ├─► eager           │        │                └──► tree_search
                        └─► lookup          │        └──► packs (sizes)
    evaluate ─► concurrent ──► engine ──────┤
    regenerate ─┬─► batched ──► batched_step┘ (sampling), memory
                └─► hf_generate (families the static models do not cover)
    evaluate ─► summary;  engine, ddtree, eager, lookup, runner, summary ──► types

Lower layers never import a stage module (tests/test_imports.py): stages call in, results come
back as `Decoded`.
"""
