"""Process-global patches applied by the plugin in every vLLM process (see ``MANIFEST``)."""
