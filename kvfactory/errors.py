"""Exceptions raised by kvfactory. Each one names the numbers or keys involved."""


class KVFactoryError(Exception):
    """Base class for every error kvfactory raises on purpose."""


class ConfigError(KVFactoryError, ValueError):
    """A cache config is invalid: unknown key, wrong type or impossible value."""

    def __init__(self, key: str, value: object, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid cache config: {key}={value!r}; allowed: {allowed}")


class CacheFullError(KVFactoryError, RuntimeError):
    """The block pool cannot hold the tokens asked for; nothing was written."""

    def __init__(self, layer: int, needed_blocks: int, free_blocks: int, total_blocks: int, page_size: int):
        self.layer, self.needed_blocks = layer, needed_blocks
        self.free_blocks, self.total_blocks, self.page_size = free_blocks, total_blocks, page_size
        super().__init__(
            f"KV pool exhausted at layer {layer}: need {needed_blocks} free blocks of {page_size} tokens, "
            f"{free_blocks} of {total_blocks} are free; free finished sequences or give a larger pool "
            f"(pool_tokens / pool_blocks / pool_bytes)"
        )


class AllocationError(KVFactoryError, RuntimeError):
    """Storage could not allocate the memory a write needs (the allocator refused); nothing was written."""


class ShapeError(KVFactoryError, ValueError):
    """Key/value tensors do not match each other or what the cache already holds."""


class LayerIndexError(ShapeError, IndexError):
    """A layer index the cache does not have: an ``IndexError``, and a ``ShapeError`` like the other
    checks of a write."""

    def __init__(self, layer: object, num_layers: int):
        self.layer, self.num_layers = layer, num_layers
        super().__init__(f"layer {layer!r} is out of range: this cache has {num_layers} layers "
                         f"(0..{num_layers - 1})")


class TensorTypeError(KVFactoryError, TypeError):
    """Keys or values that are not floating-point torch tensors."""


class UnsupportedError(KVFactoryError, NotImplementedError):
    """The cache's strategies do not offer the operation asked for (yet); nothing was changed."""


class UnknownSequenceError(KVFactoryError, KeyError):
    """A ``KVCacheManager`` holds no sequence of that id."""

    def __init__(self, seq_id: str, known: list[str]):
        self.seq_id = seq_id
        shown = ", ".join(repr(k) for k in known[:8]) + (", ..." if len(known) > 8 else "")
        super().__init__(f"no sequence {seq_id!r} in this manager ({len(known)} held: {shown or 'none'})")

    def __str__(self) -> str:  # KeyError would print the message quoted
        return self.args[0]


class SequenceStateError(KVFactoryError, RuntimeError):
    """The sequence exists but is not in a state that allows the operation (e.g. resumed twice)."""


class SequenceFileError(KVFactoryError, ValueError):
    """A saved sequence file is corrupted, truncated, written for another model or cache, or its path
    cannot be written or read (a directory, a missing or read-only folder)."""
