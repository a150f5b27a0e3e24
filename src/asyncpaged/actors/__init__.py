"""The engine's actors: thin async shells around the synchronous cores, one per file."""
