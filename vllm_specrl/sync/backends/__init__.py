"""vLLM weight-transfer backends (``--weight-transfer-config``): ``specrl_shm`` and
``specrl_gloo``, registered with vLLM's factory by path."""
