"""Error type of the weights package (torch-free, so the CLI can catch it without importing torch)."""


class WeightsError(Exception):
    """A checkpoint or converted-weights directory is missing, incomplete or corrupt (CLI exit code 4)."""
