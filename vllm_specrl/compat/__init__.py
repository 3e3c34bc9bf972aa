"""Where vllm-specrl meets vLLM beyond its documented extension points: the patch registry
(``registry``). The patches themselves still live in ``vllm_specrl.vllm_compat`` while they move here."""
