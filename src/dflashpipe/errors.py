"""Errors a user can act on. The CLI prints them as one message (no traceback) and exits 2."""


class DflashpipeError(Exception):
    """Base class: the message names the file, row, key or value at fault and what was expected."""


class ConfigError(DflashpipeError):
    """The configuration is invalid."""


class DataError(DflashpipeError):
    """An input file is missing, unreadable or not in the expected format."""


class IntegrityError(DflashpipeError):
    """A checksum does not match the recorded one."""


class DiskFullError(DflashpipeError):
    """An output could not be written for lack of space (or a file size limit)."""


class OutputBusyError(DflashpipeError):
    """Another live process holds the lock of the output this job would write."""
