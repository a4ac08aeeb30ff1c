"""Everything that decodes: static models, engines, tree search, lookup, the eager loop."""
