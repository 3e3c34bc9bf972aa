"""Every other load path watched: vLLM's native weight-transfer API, ``reload_weights`` and
worker extensions, seen in the worker, turned into versions in the engine core and
learned by the API servers."""
