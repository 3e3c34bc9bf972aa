"""The drafter's lifecycle: what keeps the draft that serves the one that was published.

RL jobs refit, sleep, wake and reload engines; each of these can leave the drafter damaged or empty
while vLLM serves on at plain speed or worse, with no error. The plugin keeps a host copy of the draft
that serves (from its first load on), checks the drafter's fingerprint after every event and
periodically, and repairs it from that copy (``worker``); the engine core drives the checks, gates
drafting in ``refuse`` mode, and raises a collapse alarm when acceptance falls to nothing after an
event (``engine_core``, ``collapse``); start-up checks catch a draft that cannot cover the engine's
positions or vocabulary (``load_checks``). docs/drafter-lifecycle.md lists every event and what a user
sees.
"""
