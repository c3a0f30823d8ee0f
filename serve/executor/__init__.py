"""Executors: run an engine's workers (one per tensor-parallel rank) behind one interface."""
