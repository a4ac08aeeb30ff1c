"""Everything that decodes: greedy decoding with a target and, optionally, a drafter.

    types           Decoded (one response), the Proposer protocol, clock and finish
    static_models   StaticTarget / StaticDrafter: the models over fixed KV buffers (check_target)
    engine          Engine: static caches, fixed-shape steps as CUDA graphs; a registry of step
                    families (Engine.register_steps) for plug-ins
    tree_search     DDTree's draft trees: best-first search (host and device), walk
    ddtree          DDTree verification on the engine; registers the "ddtree" step family
    lookup          prompt lookup: the n-gram proposer, its replay, the configuration sweep
    eager           the eager reference loop (DynamicCache), DFlashProposer; CPU fallback
    runner          Decoders: the methods evaluate compares, on the engine or the eager loop
    summary         metrics.json's figures from the responses (tau, speed, losslessness)

    evaluate ─► runner ─┬─► engine ──► static_models ──► tree_search
                        │     ▲
                        │     └── ddtree (registers its step family) ──► tree_search
                        ├─► eager ──► dflashpipe.taps (the same taps as extract)
                        └─► lookup
    evaluate ─► summary
    engine, ddtree, eager, lookup, runner, summary ──► types

Lower layers never import a stage module (tests/test_layout.py): stages call in, results come
back as `Decoded`.
"""
