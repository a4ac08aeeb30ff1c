"""dflashpipe: offline, staged training of DFlash drafters for speculative decoding."""

__version__ = "0.1.0"
