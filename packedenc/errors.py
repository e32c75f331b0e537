"""Errors (and the one warning) packedenc raises on bad input. All errors are ValueErrors, so callers
can catch one type; each message names the argument or file and shows the bad value."""


class PackedEncError(ValueError):
    """Base class: something the caller passed or pointed at is not what packedenc supports."""


class InputError(PackedEncError):
    """A bad argument to a public function: ids / cu_seqlens / positions / features handed to
    `encode`, `pack` or a pooling function, a dtype or device that cannot be right, bad texts."""


class InputTypeError(InputError, TypeError):
    """An argument of the wrong type (a string where a list of texts belongs, a bytes text...).
    Also a TypeError, for callers that catch that."""


class ConfigError(PackedEncError):
    """A config.json (or config object) names a model type or flag packedenc does not support, or
    a backend that cannot run on the given device."""


class CheckpointError(PackedEncError):
    """A checkpoint has missing, unexpected, mis-shaped or unreadable tensors, or cannot be found,
    written or trusted (an interrupted save)."""


class CheckpointWarning(UserWarning):
    """`load` skipped tensors of a checkpoint that lie outside the encoder (task heads packedenc
    does not model); `strict=True` makes them an error."""
