"""Target models that ship with the plugin (see :mod:`ubtree_vllm.models.default_target`)."""
