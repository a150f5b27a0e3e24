"""The engine a host embeds: ``AsyncEngine`` and the synchronous ``LLM``, their startup, submission
and lifecycle."""
