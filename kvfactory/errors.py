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


class ShapeError(KVFactoryError, ValueError):
    """Key/value tensors do not match each other or what the cache already holds."""
