"""UBTree tree speculative decoding for vLLM, as a fork-free plugin.

vLLM discovers the plugin through the ``vllm.general_plugins`` entry point
(:func:`ubtree_vllm.plugin.register`).  Importing this package has no side
effects: it patches nothing, registers nothing and imports neither torch nor
vLLM.
"""

__version__ = "0.1.0"
