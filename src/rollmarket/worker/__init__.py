"""Real rollout workers: an engine (embedded or any OpenAI-compatible server), the agent loop and
a verifier, feeding an exchange. `rollmarket worker` runs one. Imports stay light (no torch)."""
