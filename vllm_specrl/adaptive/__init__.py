"""Adaptive k: the number of speculative tokens chosen per step from live acceptance and cost."""
