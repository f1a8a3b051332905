"""kvstack streaming attention + KV paging: an open KV connector for vLLM (see docs/streaming.md).

Select it with ``--kv-transfer-config '{"kv_connector": "StreamingConnector",
"kv_connector_module_path": "kvstack.streaming", "kv_role": "kv_both"}'``.
"""

from .config import StreamingConfig, selects_layer
from .host_tier import HostStore, HostTierFull, PagePool

__all__ = ["StreamingConfig", "selects_layer", "HostStore", "HostTierFull", "PagePool",
           "StreamingConnector"]


def __getattr__(name):  # vLLM is imported only when the connector itself is asked for
    if name == "StreamingConnector":
        from .connector import StreamingConnector

        return StreamingConnector
    raise AttributeError(name)
