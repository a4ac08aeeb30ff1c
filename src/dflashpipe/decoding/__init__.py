"""Everything that decodes: the static engine, its plug-ins, the eager reference loop, prompt
lookup, and the figures evaluate reports from the responses."""
