"""Many sequences over one block pool: ``KVCacheManager`` (``manager.py``), the prefix cache
(``prefix.py``), the host tier's sequence state (``state.py``) and saved files (``persist.py``)."""

from kvfactory.manager.manager import KVCacheManager

__all__ = ["KVCacheManager"]
