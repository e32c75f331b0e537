"""Errors packedenc raises on bad input. All are ValueErrors, so callers can catch one type."""


class PackedEncError(ValueError):
    """Base class: something the caller passed or pointed at is not what packedenc supports."""


class InputError(PackedEncError):
    """Bad ids / cu_seqlens / features handed to `encode`, `pack` or a pooling function."""


class ConfigError(PackedEncError):
    """A config.json (or config object) names a model type or flag packedenc does not support."""


class CheckpointError(PackedEncError):
    """A checkpoint has missing, unexpected or mis-shaped tensors, or cannot be found."""
