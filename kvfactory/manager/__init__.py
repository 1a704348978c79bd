"""Many sequences over one block pool: ``KVCacheManager`` (``manager.py``), each sequence's record
and status (``sequence.py``), the prefix cache (``prefix.py``), the host tier's sequence state
(``state.py``) and saved files (``persist.py``)."""

from kvfactory.manager.manager import KVCacheManager
from kvfactory.manager.sequence import Sequence, SequenceStatus

__all__ = ["KVCacheManager", "Sequence", "SequenceStatus"]
