"""The streaming connector's logger: a child of vLLM's ``vllm`` logger.

vLLM configures only its own logger tree (``vllm``: its handler, format and
``VLLM_LOGGING_LEVEL``; ``propagate`` off). A logger outside that tree has no handler in a
``vllm serve`` process: its INFO lines are dropped and its warnings reach stderr through
Python's last-resort handler, without vLLM's format. Named ``vllm.kvstack.streaming``, the
connector's lines (the host tier's page-locking, prefix reuse, cache resets, the shared
tier) go where vLLM's own go, in its format, and follow the same settings, including a
logging config of the user's own (``VLLM_LOGGING_CONFIG_PATH``). Naming a logger needs no
import of vLLM.
"""

import logging

logger = logging.getLogger("vllm.kvstack.streaming")
